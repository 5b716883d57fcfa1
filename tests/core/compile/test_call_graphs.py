"""core/compile/call_graphs.py: whole compiled calls captured and replayed -- a graph per call structure, fresh inputs
copied into its static ones, outputs copied out, a capture again where the weights moved, failures counted and the
call run without a graph, the graph count bounded; and the compiled FLUX model through it.

CUDA graphs need a GPU: here a capture stand-in records the call and replays it into the same output memory, as a
graph does (reads its static inputs, overwrites its output), so what FluxAccel's own code does around the graph is
checked on the CPU; the capture itself runs in the GPU runs (bench/probes/graph_capture.py, bench/device.sh)."""
import dataclasses

import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.call_graphs import CallGraphs, rebuilt, structure, weight_addresses
from fluxaccel.core.compile.shapes import ShapeKey

KEY = ShapeKey(1, 2, 2, 0, "float32")
OTHER = ShapeKey(1, 4, 4, 0, "float32")


class Replayed:
    """A stand-in for torch.cuda.CUDAGraph: capturing runs the call once (its output memory is the graph's); replay
    runs it again on whatever the captured inputs hold now and writes the result into that same memory."""

    def __init__(self, run):
        self.run, self.out, self.replays = run, run(), 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.run())


def cpu_capture(run):
    g = Replayed(run)
    return g, g.out


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([2.0]), requires_grad=False)

    def forward(self, x, t, opts=None):
        return x * self.w + t


def test_replays_read_each_calls_inputs_and_outputs_are_copies():
    m = Scale()
    cg = CallGraphs(capture=cpu_capture)
    outs = [cg(KEY, m, m, (torch.full((2,), float(i)), torch.tensor([1.0])), {}) for i in range(4)]
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0], [7.0, 7.0]]
    # the first call uncaptured, the second captured and replayed, later ones replayed
    assert (cg.uncaptured, cg.captures, cg.replays, len(cg.graphs)) == (1, 1, 3, 1)
    (g,) = cg.graphs.values()
    assert all(o.data_ptr() != g.out.data_ptr() for o in outs)


def test_a_graph_per_call_structure_and_objects_by_identity():
    m = Scale()
    cg = CallGraphs(capture=cpu_capture)
    table_a, table_b = {"f": lambda: 0}, {"f": lambda: 0}
    calls = [(KEY, (torch.ones(2), torch.zeros(1)), {"opts": table_a}),
             (KEY, (torch.ones(2), torch.zeros(1)), {"opts": table_b}),  # another object: another graph
             (KEY, (torch.ones(3), torch.zeros(1)), {"opts": table_a}),  # another shape
             (OTHER, (torch.ones(2), torch.zeros(1)), {"opts": table_a}),
             (KEY, (torch.ones(2), torch.zeros(1)), {"opts": 1}), (KEY, (torch.ones(2), torch.zeros(1)), {"opts": 2})]
    for _ in range(3):
        for key, args, kwargs in calls:
            cg(key, m, lambda x, t, opts: x * 2 + t, args, kwargs)
    assert (len(cg.graphs), cg.captures, cg.replays, cg.uncaptured) == (6, 6, 12, 6)


def test_structure_round_trip():
    f = object()
    value = ((torch.ones(2),), {"a": [torch.zeros(1), 3, "s", None], "b": f, "c": (1.5, torch.ones(1, 2))})
    spec, tensors, objects = structure(value)
    assert len(tensors) == 3 and objects == [f]
    again = rebuilt(value, [t + 1 for t in tensors])
    assert torch.equal(again[0][0], torch.full((2,), 2.0)) and again[1]["a"][1:] == [3, "s", None]
    assert again[1]["b"] is f and isinstance(again[1]["c"], tuple) and torch.equal(again[1]["c"][1], torch.full((1, 2), 2.0))
    assert structure(rebuilt(value, [t + 1 for t in tensors]))[0] == spec
    assert structure(({"a": torch.ones(2, dtype=torch.float16)},))[0] != structure(({"a": torch.ones(2)},))[0]


def test_moved_weights_capture_again():
    m = Scale()
    cg = CallGraphs(capture=cpu_capture)
    args = (torch.ones(2), torch.zeros(1))
    for _ in range(3):
        cg(KEY, m, m, args, {})
    before = weight_addresses(m)
    m.w = torch.nn.Parameter(torch.tensor([5.0]), requires_grad=False)  # as a reload puts weights elsewhere
    assert weight_addresses(m) != before
    out = cg(KEY, m, m, args, {})
    assert out.tolist() == [5.0, 5.0] and (cg.recaptures, cg.captures) == (1, 2)
    assert cg(KEY, m, m, args, {}).tolist() == [5.0, 5.0] and cg.recaptures == 1


def test_failed_capture_counted_kept_and_run_without_a_graph(caplog):
    def refuse(run):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    m = Scale()
    cg = CallGraphs(capture=refuse)
    outs = [cg(KEY, m, m, (torch.full((2,), float(i)), torch.zeros(1)), {}) for i in range(4)]
    assert [o.tolist()[0] for o in outs] == [0.0, 2.0, 4.0, 6.0]
    assert cg.failures() == {KEY: "RuntimeError: operation not permitted when stream is capturing"}
    assert (cg.captures, cg.replays, cg.uncaptured, len(cg.kept)) == (0, 0, 4, 1)
    assert any("could not be captured" in r.getMessage() and "without a graph" in r.getMessage() for r in caplog.records)
    assert cg.counts()["failed"] == {KEY.describe(): "RuntimeError: operation not permitted when stream is capturing"}


def test_inputs_that_change_at_every_call_are_said_not_replayed(caplog):
    """An input object made anew for each call (a structure never seen twice): past CHURN structures the shape is
    said to run without graphs, naming the input; the calls stay right, and another shape still gets its graph."""
    from fluxaccel.core.compile.call_graphs import CHURN

    m = Scale()
    cg = CallGraphs(capture=cpu_capture)
    outs = [cg(KEY, m, lambda x, t, opts: x * 2 + t, (torch.full((2,), float(i)), torch.zeros(1)),
               {"opts": {"stable": 1, "per_call": object()}}) for i in range(CHURN + 3)]
    assert [o.tolist()[0] for o in outs] == [2.0 * i for i in range(CHURN + 3)]
    assert cg.captures == 0 and cg.uncaptured == CHURN + 3 and set(cg.failures()) == {KEY}
    assert "call[1]['opts']['per_call'] differs" in cg.failures()[KEY]
    assert len(cg.seen) == 0  # what was remembered for the shape is let go
    assert sum("no graph is replayed" in r.getMessage() for r in caplog.records) == 1
    for _ in range(3):
        cg(OTHER, m, m, (torch.ones(3), torch.zeros(1)), {})
    assert cg.captures == 1 and cg.replays == 2


def test_one_steady_structure_beside_churning_ones():
    """A shape with one structure that replays (cond) and one that is new at every call (uncond with a per-call
    object): the steady one keeps replaying, the churning ones are said once past CHURN, and nothing of them is kept."""
    from fluxaccel.core.compile.call_graphs import CHURN

    m = Scale()
    cg = CallGraphs(capture=cpu_capture)
    for i in range(CHURN + 4):
        cg(KEY, m, lambda x, t, opts: x + t, (torch.ones(2), torch.zeros(1)), {"opts": 0})
        cg(KEY, m, lambda x, t, opts: x + t, (torch.ones(2), torch.zeros(1)), {"opts": object()})
    assert cg.captures == 1 and KEY in cg.churn and len(cg.seen) == 0
    assert cg.replays == CHURN + 3  # the steady structure: captured at its second call and replayed from then on


def test_first_difference_names_the_input():
    from fluxaccel.core.compile.call_graphs import first_difference

    a = structure(((torch.ones(2),), {"o": {"k": 1, "f": "x"}}))[0]
    assert first_difference(a, structure(((torch.ones(2),), {"o": {"k": 2, "f": "x"}}))[0]) == "call[1]['o']['k']"
    assert first_difference(a, structure(((torch.ones(3),), {"o": {"k": 1, "f": "x"}}))[0]) == "call[0][0]"
    assert first_difference(a, structure(((torch.ones(2),), {"o": {"k": 1}}))[0]) == "call[1]['o'] (keys ['f'])"
    assert first_difference(a, a) == ""


def test_graph_count_bounded(caplog):
    m = Scale()
    cg = CallGraphs(limit=2, capture=cpu_capture)
    for _ in range(3):
        for n in (2, 3, 4):
            cg(KEY, m, m, (torch.ones(n), torch.zeros(1)), {})
    assert len(cg.graphs) == 2 and cg.over_limit == 2 and cg.uncaptured == 3 + 2
    assert sum("(its limit)" in r.getMessage() for r in caplog.records) == 1


# -- the compiled FLUX model with its calls captured ----------------------------------------------------------------
@pytest.mark.fresh_compile
def test_compiled_flux_blocks_compiled_on_their_own_and_calls_captured(fresh_dynamo):
    """graph_capture "call": each kind of block compiled on its own through the block table (the C++ wrapper, as on a
    GPU), FluxAccel's single-block forward kept, the model around the blocks uncompiled and each call captured (the
    stand-in here): a sampling run equals the uncompiled model's (float32: the C++ wrapper's CPU GEMM call refuses
    bf16), the second run replays every call, two dynamo graphs (one per block kind), each saved as a warm-start
    package; a new CompiledFlux (what a restarted ComfyUI builds) loads both and traces nothing, with the same output."""
    import comfy.model_management as mm

    from fluxaccel.core.compile import block_regions
    from fluxaccel.core.compile.compiled import CompiledFlux
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import _install, remove_compile
    from fluxaccel.core.compile.progress import CompileWatch
    from support.models import build_flux
    from support.runs import sample

    model = build_flux(dtype=torch.float32)
    # compiled in this process (the C++ wrapper patched in below; test_separate.py has the separate process)
    cfg = CompileConfig(separate_process=False)
    gpu = cfg.inductor_options(torch.device("cuda"))
    assert not cfg.nested_regions and gpu["cpp_wrapper"] is True and gpu["triton.cudagraphs"] is False
    assert gpu["cpp.vec_isa_ok"] is False  # the GPU wrapper's CPU ISA is not checked (config.py)
    mm.load_models_gpu([model])
    dm = model.model.diffusion_model

    def compiled_flux():
        # the CPU's options with the C++ wrapper the GPU's carry (graphs, and so the wrapper, are CUDA-only options)
        with pytest.MonkeyPatch.context() as monkey:
            monkey.setattr(CompileConfig, "inductor_options",
                           lambda self, device: {"cpp_wrapper": True, "emulate_precision_casts": True})
            c = CompiledFlux(dm, cfg, torch.device("cpu"))
        c.runner.call_graphs = CallGraphs(capture=cpu_capture)
        return c, _install(model.clone(), c)[0]

    compiled, clone = compiled_flux()
    assert compiled.runner.compiled is dm and compiled.runner.packages is None and compiled.separate is None
    assert compiled.regions._double is not block_regions._double  # compiled on its own, not a nested region
    ref = sample(remove_compile(clone), steps=3)
    first = sample(clone, steps=3)
    again = sample(clone, steps=3)
    cg = compiled.runner.call_graphs
    assert rel_err(first, ref) < 1e-4 and torch.equal(again, first)
    assert (cg.captures, cg.uncaptured, cg.replays) == (1, 1, 5)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert compiled.stats.calls == 6 and compiled.stats.marks == 0 and compiled.graphs_running is False  # CPU
    assert list(compiled.stats.warm_start.values()) == ["saved"]
    assert len(compiled.packages.store.signatures()) == 2  # one package per block kind
    restarted, clone2 = compiled_flux()
    marked = []  # the compile's progress says "loading the warm-start package" while each block kind's loads
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(CompileWatch, "loading_package",
                       lambda self, real=CompileWatch.loading_package: (marked.append(self.what), real(self))[1])
        assert torch.equal(sample(clone2, steps=3), first)
    assert list(restarted.stats.warm_start.values()) == ["loaded"] and fresh_dynamo["stats"]["unique_graphs"] == 2
    assert len(marked) == 2 and all("latent" in m for m in marked)


def test_graph_capture_call_or_graphs_off_said(monkeypatch):
    """graph_capture "call" runs where a C++ compiler is found, under any allocator; where it cannot, and where
    inductor's graphs cannot run (cudaMallocAsync), graphs are off and the reason names the setting."""
    from fluxaccel.core.compile import patch
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.upstream import torch_internals

    cuda = torch.device("cuda")
    monkeypatch.setattr(patch, "cuda_graph_blockers", lambda device: ["cudaMallocAsync here"])
    cfg, off = patch._graphs_under(CompileConfig(separate_process=False), cuda, "node")
    assert cfg.captured and not off
    assert "each model call captured whole" in cfg.summary() and "each kind of block, compiled" in cfg.summary()
    cfg, off = patch._graphs_under(CompileConfig(separate_process=False), cuda, "node")
    assert not cfg.cuda_graphs and "cudaMallocAsync here" in off and "graph_capture to 'call'" in off
    monkeypatch.setattr(torch_internals, "cpp_compiler", lambda: "")
    cfg, off = patch._graphs_under(CompileConfig(separate_process=False), cuda, "node")
    assert not cfg.cuda_graphs and "graph_capture 'call' cannot run here" in off and "no C++ compiler" in off
    monkeypatch.setattr(patch, "cuda_graph_blockers", lambda device: [])
    inductor = CompileConfig(separate_process=False)
    assert patch._graphs_under(inductor, cuda, "node") == (inductor, "")
    assert patch._graphs_under(CompileConfig(separate_process=False), torch.device("cpu"), "node")[1] == ""


def test_graph_capture_auto_is_call_where_it_can_run(monkeypatch):
    """graph_capture "auto" (the default): "call" on a CUDA device with graphs and block_regions on and a C++ compiler;
    "inductor" on the CPU, with graphs or block_regions off, and where no C++ compiler is found -- then under
    cudaMallocAsync graphs are off and the reason names both."""
    from fluxaccel.core.compile import patch
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.upstream import torch_internals

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert CompileConfig(separate_process=False).graph_capture == "auto" and not CompileConfig(separate_process=False).captured
    monkeypatch.setattr(torch_internals, "cpp_compiler", lambda: "/usr/bin/g++")
    monkeypatch.setattr(patch, "cuda_graph_blockers", lambda device: ["cudaMallocAsync here"])
    cfg, off = patch._graphs_under(CompileConfig(separate_process=False), cuda, "node")
    assert cfg.graph_capture == "call" and cfg.captured and off == ""
    assert patch.resolve_capture(CompileConfig(separate_process=False), cpu) == (CompileConfig(separate_process=False), "")
    assert patch.resolve_capture(CompileConfig(separate_process=False), cuda)[0].graph_capture == "inductor"
    assert patch.resolve_capture(CompileConfig(separate_process=False), cuda)[0].graph_capture == "inductor"
    assert patch.resolve_capture(CompileConfig(separate_process=False), cuda)[0].graph_capture == "inductor"
    monkeypatch.setattr(torch_internals, "cpp_compiler", lambda: "")
    cfg, why = patch.resolve_capture(CompileConfig(separate_process=False), cuda)
    assert cfg.graph_capture == "inductor" and "graph_capture 'call' cannot run here" in why and "C++ compiler" in why
    cfg, off = patch._graphs_under(CompileConfig(separate_process=False), cuda, "node")
    assert not cfg.cuda_graphs and "cudaMallocAsync here" in off and "graph_capture 'call' cannot run here" in off
    monkeypatch.setattr(patch, "cuda_graph_blockers", lambda device: [])
    assert patch._graphs_under(CompileConfig(separate_process=False), cuda, "node") == (CompileConfig(separate_process=False), "")


@pytest.mark.parametrize("arch", ["flux2", "chroma"])
def test_call_mode_compiles_flux2_and_chroma_blocks_on_their_own(arch, fresh_dynamo):
    """graph_capture "call" (what "auto" is on a GPU) for FLUX.2 and Chroma: each block kind compiled on its own, the
    model around them uncompiled; the output equals eager's (float32, the CPU: no capture here)."""
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from support.models import build_flux
    from support.runs import denoise_once
    from support.shapes import TINY_CHROMA, TINY_FLUX2

    shape = {"flux2": TINY_FLUX2, "chroma": TINY_CHROMA}[arch]
    model = build_flux({**shape, "depth": 2, "depth_single_blocks": 3}, dtype=torch.float32)
    hw = 8 if arch == "flux2" else 16
    ref = denoise_once(model, hw=hw)
    compiled_model, compiled = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    assert compiled.cfg.captured and compiled.runner.compiled is compiled.runner.dm
    assert rel_err(denoise_once(compiled_model, hw=hw), ref) < 1e-4
    assert fresh_dynamo["stats"]["unique_graphs"] == 2  # one per block kind


def test_config_refuses_what_call_capture_cannot_do():
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.errors import FluxAccelError

    with pytest.raises(FluxAccelError, match="graph_capture must be one of"):
        CompileConfig(separate_process=False)
    with pytest.raises(FluxAccelError, match="graph_capture 'call' compiles each kind.*turn block_regions on"):
        CompileConfig(separate_process=False)
    assert CompileConfig(separate_process=False).nested_regions is False
    assert CompileConfig(separate_process=False).nested_regions is True
    assert dataclasses.replace(CompileConfig(separate_process=False), graph_capture="call").captured


def test_call_mode_through_apply_compile_and_warmup(tiny_flux, fresh_dynamo):
    """graph_capture "call" as the Compile node sets it, on ComfyUI's real objects (CPU: blocks compiled on their own,
    no capture): the denoiser as eager's, Warmup compiles both block kinds before the first prompt and the prompts
    after compile nothing, the label carries no '+regions' (no nested regions), the stats name the mode."""
    import comfy.sample

    from fluxaccel.core.bench.metrics import rel_err
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile, compiled_of
    from fluxaccel.core.compile.warmup import warmup
    from fluxaccel.core.patches import describe, label
    from support.models import synthetic_conditioning
    from support.runs import denoise_once

    ref = denoise_once(tiny_flux, hw=16)
    clone, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    assert compiled.runner.compiled is compiled._dm and compiled.runner.call_graphs is None  # CPU: nothing to capture
    assert rel_err(denoise_once(clone, hw=16), ref) < 2e-2
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    model, secs = warmup(clone, [(128, 128)], text_length=16, steps=2)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2 and len(secs) == 1  # the blocks were compiled at this shape
    pos = synthetic_conditioning("tiny", text_len=16, seed=42)
    latent = torch.zeros(1, 16, 16, 16)
    comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 3, 1.0, "euler", "simple", pos, pos, latent,
                        disable_pbar=True, seed=7)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert label(model).endswith("+compile") and describe(model)["compile"]["graph_capture"] == "call"
    assert compiled_of(model).cfg.captured
