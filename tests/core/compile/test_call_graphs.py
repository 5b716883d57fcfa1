"""core/compile/call_graphs.py: whole compiled calls captured and replayed -- a graph per call structure, fresh inputs
copied into its static ones, outputs copied out, a capture again where the weights moved, failures counted and the
call run without a graph, the graph count bounded; and the compiled FLUX model through it.

CUDA graphs need a GPU: here a capture stand-in records the call and replays it into the same output memory, as a
graph does (reads its static inputs, overwrites its output), so what FluxAccel's own code does around the graph is
checked on the CPU; the capture itself runs in the GPU runs (bench/device.sh)."""
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
    """Each kind of block compiled on its own through the block table (the C++ wrapper, as on a GPU), FluxAccel's
    single-block forward kept, the model around the blocks uncompiled and each call captured (the stand-in here): a
    sampling run equals the uncompiled model's (float32: the C++ wrapper's CPU GEMM call refuses bf16), the second run
    replays every call, two dynamo graphs (one per block kind), each saved as a warm-start package; a new CompiledFlux
    (what a restarted ComfyUI builds) loads both and traces nothing, with the same output."""
    import comfy.model_management as mm

    from fluxaccel.core.compile.compiled import CompiledFlux, Setup
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import _install, remove_compile
    from fluxaccel.core.compile.progress import CompileWatch
    from support.models import build_flux
    from support.runs import sample

    model = build_flux(dtype=torch.float32)
    # compiled in this process (test_separate.py has the separate process)
    cfg = CompileConfig(separate_process=False)
    gpu = cfg.inductor_options(capture=True)
    assert gpu["cpp_wrapper"] is True and gpu["triton.cudagraphs"] is False
    assert gpu["cpp.vec_isa_ok"] is False  # the GPU wrapper's CPU ISA is not checked (config.py)
    mm.load_models_gpu([model])
    dm = model.model.diffusion_model

    def compiled_flux():
        # the C++ wrapper a captured call's blocks compile with, with the CPU's vector ISA (its kernels are CPU ones)
        c = CompiledFlux(dm, cfg, Setup(torch.device("cpu"), {"cpp_wrapper": True, "emulate_precision_casts": True},
                                        "test-call-graphs"))
        c.runner.call_graphs = CallGraphs(capture=cpu_capture)
        return c, _install(model.clone(), c)[0]

    compiled, clone = compiled_flux()
    assert compiled.separate is None
    ref = sample(remove_compile(clone), steps=3)
    first = sample(clone, steps=3)
    again = sample(clone, steps=3)
    cg = compiled.runner.call_graphs
    assert rel_err(first, ref) < 1e-4 and torch.equal(again, first)
    assert (cg.captures, cg.uncaptured, cg.replays) == (1, 1, 5)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert compiled.stats.calls == 6 and compiled.graphs_running  # the stand-in captured every call
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


def test_calls_are_captured_on_a_gpu_with_a_cpp_compiler_and_otherwise_said(monkeypatch):
    """FluxAccel captures calls on a CUDA device where inductor's C++ wrapper can be built (any allocator); elsewhere
    the reason names what is missing, and the node's text says it."""
    from fluxaccel.core.compile import patch
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.upstream import torch_internals

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch_internals, "cpp_compiler", lambda: "/usr/bin/g++")
    assert patch.capture_unavailable(cuda) == ""
    assert "each model call captured into a CUDA graph" in CompileConfig().summary("")
    monkeypatch.setattr(torch_internals, "cpp_compiler", lambda: "")
    why = patch.capture_unavailable(cuda)
    assert "no C++ compiler" in why and "install g++" in why
    assert f"no CUDA graphs: {why}" in CompileConfig().summary(why)
    assert patch.capture_unavailable(torch.device("cpu")) == "this model runs on the CPU; CUDA graphs need a CUDA GPU"


@pytest.mark.fresh_compile  # counts what dynamo traces: no warm-start package another test saved
def test_through_apply_compile_and_warmup(tiny_flux, fresh_dynamo):
    """As the Compile node sets it up, on ComfyUI's real objects (CPU: blocks compiled on their own, no capture): the
    denoiser as eager's, Warmup compiles both block kinds before the first prompt and the prompts after compile
    nothing; the text, the label and the stats say that no CUDA graph runs here, and why."""
    import comfy.sample

    from fluxaccel.core.bench.metrics import rel_err
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.compile.warmup import WarmupPlan, warmup
    from fluxaccel.core.patches import describe, label
    from fluxaccel.nodes.events import compiled_state
    from support.models import synthetic_conditioning
    from support.runs import denoise_once

    ref = denoise_once(tiny_flux, hw=16)
    clone, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    assert compiled.runner.call_graphs is None  # CPU: nothing to capture
    state = compiled_state(compiled)
    assert state["graphs"] is False and "no CUDA graphs: this model runs on the CPU" in state["text"]
    assert state["graphs_off"] in state["text"] and "captured into a CUDA graph" not in state["text"]
    assert rel_err(denoise_once(clone, hw=16), ref) < 2e-2
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    model, secs = warmup(clone, WarmupPlan([(128, 128)], text_length=16, steps=2))
    assert fresh_dynamo["stats"]["unique_graphs"] == 2 and len(secs) == 1  # the blocks were compiled at this shape
    pos = synthetic_conditioning("tiny", text_len=16, seed=42)
    latent = torch.zeros(1, 16, 16, 16)
    comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 3, 1.0, "euler", "simple", pos, pos, latent,
                        disable_pbar=True, seed=7)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert label(model).endswith("+compile") and "CUDA GPU" in describe(model)["compile"]["graphs_off_reason"]
