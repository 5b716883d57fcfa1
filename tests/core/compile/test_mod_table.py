"""core/compile/mod_table.py: every block modulation computed once per sampling run and looked up at each call, on
ComfyUI's own FLUX blocks and sampler (tiny FLUX, CPU; the Triton kernel in Triton's interpreter).

What is checked: the operator copies matched rows and computes the others as ComfyUI's Linear does; the table is
recognised by the source it reads (ComfyUI 0.33.0's), and refused with what to do where it cannot stand in; whole
sampling runs through the compiled model equal the uncompiled model's in float32, with every euler call's rows
looked up (counted), a sampler's midpoint calls computed, and no compile beyond the first; the input model keeps
ComfyUI's modulations.
"""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import comfy.ldm.flux.layers as flux_layers
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile import mod_table
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.models import swaps
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.compile.runner import ModelCall
from fluxaccel.core.quant.patch import apply_fp8
from support.models import build_flux
from support.runs import clear_compile_counters, compiled_graphs
from support.runs import sample as _sample
from support.shapes import TINY_FLUX2

ROOT = Path(__file__).resolve().parents[3]


def _operands(seed=0, b=3, d=40, n=24, rows=(1, -1, 0)):
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(b, d, generator=g).bfloat16()
    weight, bias = torch.randn(n, d, generator=g).bfloat16() / 8, torch.randn(n, generator=g).bfloat16()
    table = torch.randn(4, n, generator=g).bfloat16()
    r = torch.full((mod_table.MAX_BATCH,), -1, dtype=torch.int32)
    r[:b] = torch.tensor(rows, dtype=torch.int32)
    return vec, r, weight, bias, table


def test_operator_copies_matched_rows_and_computes_the_others():
    vec, rows, weight, bias, table = _operands()
    out = mod_table.modulation_rows(vec, rows, weight, bias, table)
    computed = torch.nn.functional.linear(torch.nn.functional.silu(vec), weight, bias)
    assert torch.equal(out[0], table[1]) and torch.equal(out[2], table[0])
    assert torch.equal(out[1], computed[1])
    compiled = torch.compile(mod_table.modulation_rows, dynamic=False)(vec, rows, weight, None, table)
    assert torch.equal(compiled[1], torch.nn.functional.linear(torch.nn.functional.silu(vec), weight)[1])
    assert torch.equal(compiled[0], table[1])


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from tools.plugin import register
register()
from tools import host
host.import_comfy()  # FluxAccel's compile modules read ComfyUI's
from fluxaccel.core.compile import mod_table
from fluxaccel.core.compile.mod_table_kernel import modulation_rows_kernel
g = torch.Generator().manual_seed(1)
vec = torch.randn(3, 100, generator=g).bfloat16()
weight, bias = (torch.randn(300, 100, generator=g) / 8).bfloat16(), torch.randn(300, generator=g).bfloat16()
table = torch.randn(5, 300, generator=g).bfloat16()
rows = torch.tensor([4, -1, 0] + [-1] * 13, dtype=torch.int32)
out = torch.empty(3, 300, dtype=torch.float32)  # float32: the kernel's values before their rounding to bf16
modulation_rows_kernel[(3, 3)](vec, rows, weight, bias, table, out, 300, 100, vec.stride(0), weight.stride(0),
                               table.stride(0), out.stride(0), HAS_BIAS=True, BLOCK_N=128, BLOCK_D=64)
ref = torch.nn.functional.linear(torch.nn.functional.silu(vec).float(), weight.float(), bias.float())
print({"copied": bool(torch.equal(out[0], table[4].float()) and torch.equal(out[2], table[0].float())),
       "computed": float(((out[1] - ref[1]).abs() / ref[1].abs().clamp(min=1)).max())})
"""


def test_the_triton_kernel_in_tritons_interpreter(tmp_path):
    """The GPU kernel by Triton's CPU interpreter: matched rows copied exactly, the unmatched row SiLU x weights +
    bias (across three column blocks and two D blocks, both ragged) within the interpreter's bf16 truncation."""
    pytest.importorskip("triton")
    script = tmp_path / "interpreted.py"
    script.write_text(_INTERPRETED)
    done = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (our own script's printed dict)
    assert result["copied"] and result["computed"] < 2 ** -6, result


def test_the_source_it_reads_is_known_and_another_is_named(tiny_flux, monkeypatch):
    dm = tiny_flux.model.diffusion_model
    assert mod_table.why_not(dm) == ""
    assert mod_table.why_not(build_flux(TINY_FLUX2).model.diffusion_model).startswith("Flux has no FLUX.1")
    monkeypatch.setattr(mod_table, "KNOWN_VECTOR", {})
    assert "forward_orig makes its vector in a way FluxAccel has not read" in mod_table.why_not(dm)
    monkeypatch.setattr(mod_table, "KNOWN_MODULATION", {})
    compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))[1]
    (d,) = [d for d in compiled.stats.degradations if d.what == "modulation table"]
    assert compiled.runner.mod_table is None and d.why.startswith(
        "comfy.ldm.flux.layers.Modulation.forward is not a modulation forward FluxAccel has read")


def test_it_is_off_and_says_why_with_fp8_modulation_weights_and_on_where_it_can_run(tiny_flux, cpu_fp8):
    fp8 = apply_fp8(tiny_flux, Fp8Config(scope="blocks+modulation"))[0]
    model, compiled = apply_compile(fp8, CompileConfig(separate_process=False))  # off, said in the text and the stats
    (d,) = [d for d in compiled.stats.degradations if d.what == "modulation table"]
    assert compiled.runner.mod_table is None and "quantized its modulation weights" in d.why
    assert "scope 'blocks' keeps them" in d.why
    assert not any(isinstance(v, mod_table.TableModulation) for _, v in swaps.items(model))
    blocks = apply_fp8(tiny_flux, Fp8Config(scope="blocks"))[0]
    compiled = apply_compile(blocks, CompileConfig(separate_process=False))[1]  # where it can run: on
    assert compiled.runner.mod_table is not None and not compiled.stats.degradations
    assert apply_compile(tiny_flux, CompileConfig(separate_process=False))[1].runner.mod_table is not None
    flux2 = build_flux(TINY_FLUX2)  # no per-block modulations: nothing to say
    assert not apply_compile(flux2, CompileConfig(separate_process=False))[1].stats.degradations


def test_sampling_runs_look_up_every_euler_call_and_equal_the_uncompiled_model():
    """float32 (compare whole runs): euler's calls are all looked up (one row per batch entry and step, counted on
    the device), dpm_2's midpoint calls computed; each run equals the uncompiled model's; a second run builds its
    own table and compiles nothing new; the input model keeps ComfyUI's Modulations."""
    clear_compile_counters()
    torch._dynamo.reset()
    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    table = compiled.runner.mod_table
    assert isinstance(swaps.get(model, "diffusion_model.single_blocks.1.modulation"), mod_table.TableModulation)
    assert not any(isinstance(v, mod_table.TableModulation) for _, v in swaps.items(base))

    assert rel_err(_sample(model, seed=1, steps=3), _sample(base, seed=1, steps=3)) < 1e-4
    assert table.counts() | {"build_s": 0} == {"rows_from_table": 3, "rows_computed": 0, "builds": 1, "build_s": 0,
                                               "build_graphs": 0, "build_graph_failed": "",
                                               "capacity_rows": mod_table.CAPACITY, "short": "",
                                               "patched_per_call": False}
    graphs = compiled_graphs()
    assert rel_err(_sample(model, seed=2, steps=3, text_seed=4), _sample(base, seed=2, steps=3, text_seed=4)) < 1e-4
    assert table.counts()["rows_from_table"] == 6 and table.builds == 2 and compiled_graphs() == graphs
    # cfg 2: cond and uncond in one call (batch 2), two rows per step; dpm_2 also calls at midpoints: computed
    assert rel_err(_sample(model, seed=3, steps=2, cfg=2.0), _sample(base, seed=3, steps=2, cfg=2.0)) < 1e-4
    assert table.counts()["rows_from_table"] == 10 and table.counts()["rows_computed"] == 0
    out, ref = _sample(model, seed=3, steps=3, sampler="dpm_2"), _sample(base, seed=3, steps=3, sampler="dpm_2")
    assert rel_err(out, ref) < 1e-4
    counts = table.counts()
    assert counts["rows_from_table"] == 10 + 3 and counts["rows_computed"] == 2, counts  # 2 midpoints, 3 sigmas
    assert torch.equal(table.rows, torch.full_like(table.rows, -1)), "rows are -1 between calls"


def test_a_lora_on_the_modulation_weights_is_in_the_table():
    """ComfyUI's own LoRA loading (LoraLoaderModelOnly's load_lora_for_models) with a LoRA on every modulation
    Linear, then Compile: the table runs (every euler call looked up), and the run equals the LoRA'd uncompiled
    model's (float32), at two strengths, each table built from the weights ComfyUI patched for it."""
    from support.models import lora_state_dict, with_lora

    base = build_flux("tiny", dtype=torch.float32)
    mods = [name for name, _ in mod_table.modulations(base.model.diffusion_model)]
    sd = lora_state_dict(base, [f"{m}.lin" for m in mods])
    refs = []
    for strength in (1.0, 0.4):
        lora = with_lora(base, sd, strength)
        model, compiled = apply_compile(lora, CompileConfig(resolution_policy="recompile", separate_process=False))
        table = compiled.runner.mod_table  # the second strength reuses the first's compiled model and its table
        assert table is not None and not compiled.stats.degradations
        before = table.counts()
        out, ref = _sample(model, seed=1, steps=3), _sample(lora, seed=1, steps=3)
        after = table.counts()
        assert rel_err(out, ref) < 1e-4 and after["rows_from_table"] - before["rows_from_table"] == 3
        assert after["builds"] > before["builds"]  # built again from the weights patched for this strength
        refs.append(ref)
    plain = _sample(base, seed=1, steps=3)
    assert rel_err(refs[0], plain) > 1e-3 and rel_err(refs[1], refs[0]) > 1e-4  # the LoRA and its strength count


def test_a_table_shorter_than_the_run_says_so_and_computes_the_rest(monkeypatch):
    monkeypatch.setattr(mod_table, "CAPACITY", 2)
    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, CompileConfig(separate_process=False))
    assert rel_err(_sample(model, seed=1, steps=3), _sample(base, seed=1, steps=3)) < 1e-4
    counts = compiled.runner.mod_table.counts()
    assert counts["rows_from_table"] == 2 and counts["rows_computed"] == 1
    assert counts["short"] == "the table holds 2 of the run's 4 sigmas at batch 1; the rest are computed"


def test_the_modulation_it_stands_in_for_is_comfyuis(tiny_flux):
    assert all(type(m) is flux_layers.Modulation for _, m in mod_table.modulations(tiny_flux.model.diffusion_model))


def test_the_model_with_its_table_rebuilds_in_another_process_from_its_skeleton(tiny_flux):
    """What a separate compile process gets: the module tree with the table's modules and keys by layout; the
    sigma-to-timestep function (ComfyUI's model_sampling, a class made inside a function) is left out."""
    from fluxaccel.core.compile import skeleton

    model, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    model.patch_model()
    try:
        blob, _ = skeleton.dumps(model.model.diffusion_model)
    finally:
        model.unpatch_model()
    back = skeleton.loads(blob, "cpu")
    m = back.double_blocks[1].txt_mod
    assert isinstance(m, mod_table.TableModulation) and m._table is back.single_blocks[0].modulation._table
    assert m._table.timestep_of is None and tuple(m._table.rows.shape) == (mod_table.MAX_BATCH,)
    assert tuple(m.values.shape) == (mod_table.CAPACITY, 6 * 256)
    assert callable(compiled.runner.mod_table.timestep_of), "the model's own table keeps its function"


def test_bf16_the_table_computes_each_input_in_the_dtype_the_call_gets_it_in(monkeypatch):
    """bf16: ComfyUI casts the guidance to the model's dtype before FLUX embeds it (x 1000: 3504 for 3.5 in bf16),
    so the table embeds it in that dtype too. Sampling with the table equals sampling without it, both compiled, to
    the table GEMM's rounding."""
    base = build_flux("tiny")
    with_table = apply_compile(base, CompileConfig(separate_process=False))
    monkeypatch.setattr(mod_table, "why_not_here", lambda model, dm: "not in this test")
    without = apply_compile(base, CompileConfig(separate_process=False))
    assert without[1].runner.mod_table is None and without[1].runner is not with_table[1].runner
    out, ref = _sample(with_table[0], seed=1, steps=2), _sample(without[0], seed=1, steps=2)
    assert with_table[1].runner.mod_table.counts()["rows_from_table"] == 2
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)  # 0.0034 here; 0.23 with the guidance embedded in float32


class _Replay:
    """A stand-in for a CUDA graph on the CPU: replay() runs the captured function again (counted)."""

    replays = 0

    def __init__(self, run):
        self.run = run

    def replay(self):
        _Replay.replays += 1
        self.run()


def _stand_in_capture(run):
    return _Replay(run), run()


def test_the_build_is_one_graph_captured_again_where_the_weights_moved_and_a_failure_is_said(caplog):
    """The build's vector MLPs and GEMMs through a capture (a stand-in on the CPU): captured at the first build,
    replayed by the next run's with that run's rows, captured again once ComfyUI has moved a modulation's or a vector
    MLP's weight; a capture that fails is said and the build runs op by op. Every run equals the uncompiled model's."""
    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    table, _Replay.replays = compiled.runner.mod_table, 0
    table.builder = mod_table.BuildGraph(_stand_in_capture)
    ref, other = _sample(base, seed=1, steps=3), _sample(base, seed=1, steps=4)
    for runs, captures in ((1, 1), (2, 1)):
        assert rel_err(_sample(model, seed=1, steps=3), ref) < 1e-4
        assert (table.builds, table.builder.captures, _Replay.replays) == (runs, captures, runs)
    assert rel_err(_sample(model, seed=1, steps=4), other) < 1e-4, "another run's sigmas through the same graph"
    assert table.builder.captures == 1 and _Replay.replays == 3
    for lin in (table.modules[5].lin, model.model.diffusion_model.time_in.in_layer):
        lin.weight.data = lin.weight.data.clone()  # the same weights elsewhere, as after ComfyUI moved them
    assert rel_err(_sample(model, seed=1, steps=3), ref) < 1e-4 and table.builder.captures == 2
    time_in = model.model.diffusion_model.time_in.out_layer
    time_in.weight.data = time_in.weight.data.clone()
    assert rel_err(_sample(model, seed=1, steps=3), ref) < 1e-4 and table.builder.captures == 3
    pickled = pickle.loads(pickle.dumps(table.builder))  # a separate compile process gets no graph of this one's
    assert (pickled.graph, pickled.inputs, pickled.weights, pickled.captures) == (None, None, (), 3)

    def refused(run):
        raise RuntimeError("capture refused")

    table.builder = mod_table.BuildGraph(refused)
    assert rel_err(_sample(model, seed=1, steps=3), ref) < 1e-4
    assert "its build could not be captured in a CUDA graph (RuntimeError: capture refused)" in caplog.text
    assert table.counts()["build_graph_failed"] == "RuntimeError: capture refused"
    assert table.counts()["rows_from_table"] == 5 * 3 + 4 and table.counts()["rows_computed"] == 0


def test_weights_patched_at_every_call_run_as_comfyuis_linear_and_are_not_looked_up(caplog):
    """ComfyUI patches some weights at every call (a module's weight_function, set when it loads the model; e.g. a
    LoRA after the Compile node): the table, which reads weights as stored, is then not used, said once; that
    modulation runs as ComfyUI's Linear, with the patch."""
    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, CompileConfig(separate_process=False))
    _sample(model, seed=1, steps=2)  # loaded, as a run finds it
    table, dm = compiled.runner.mod_table, base.model.diffusion_model
    m = table.modules[3]
    vec = torch.randn(1, 256)
    m.lin.weight_function = [lambda w: w * 2]
    try:
        call = ModelCall(torch.zeros(1, 16, 16, 16), torch.tensor([0.5]), None,
                         {"sample_sigmas": torch.tensor([1.0, 0.5, 0.0])}, {"y": torch.zeros(1, 64)})
        assert not table.prepare(dm, call)
        assert table.counts()["patched_per_call"] and "the modulation table is not used while it does" in caplog.text
        table.rows[0] = 0  # even with a row set, the patched Linear runs
        out = m(vec)[0].shift
        ref = flux_layers.Modulation.forward(m, vec)[0].shift
        assert torch.equal(out, ref) and not torch.equal(out, m.values[0, :256].view_as(out))
    finally:
        m.lin.weight_function = []
        table.rows.fill_(-1)


def test_compiled_again_or_while_another_clones_table_is_loaded_and_removed_with_the_compile(tiny_flux):
    """A second Compile node on a compiled model gets a table of its own over ComfyUI's modulations; one on the base
    model while a compiled clone's table is in the live tree reuses that compiled model and its table (the same
    model and config); removing the compile (the Benchmark's baseline) leaves ComfyUI's modulations."""
    from fluxaccel.core.compile.patch import remove_compile

    first, c1 = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    first.patch_model()  # the first clone's TableModulations are in the live tree now
    try:
        assert isinstance(tiny_flux.model.diffusion_model.double_blocks[0].img_mod, mod_table.TableModulation)
        other, c2 = apply_compile(tiny_flux, CompileConfig(separate_process=False))
        again, c3 = apply_compile(first, CompileConfig(separate_process=False))
    finally:
        first.unpatch_model()
    assert c2.runner is c1.runner and swaps.get(other, "diffusion_model.single_blocks.0.modulation") is \
        swaps.get(first, "diffusion_model.single_blocks.0.modulation")
    for m, c in ((other, c2), (again, c3)):
        assert c.runner.mod_table is not None and (c is c2 or c.runner.mod_table is not c1.runner.mod_table)
        assert all(type(t.lin).__name__ == "Linear" for t in c.runner.mod_table.modules)
        assert not c.stats.degradations
    plain = remove_compile(again)
    assert not any(isinstance(v, mod_table.TableModulation) for _, v in swaps.items(plain))
    assert isinstance(swaps.get(again, "diffusion_model.single_blocks.0.modulation"), mod_table.TableModulation)


def test_weights_stored_in_another_dtype_than_the_compute_dtype():
    """ComfyUI on a CPU stores bf16 weights and computes in float32 (its manual cast): the table's values are in the
    compute dtype and the operator casts the stored weights as ComfyUI's ops do."""
    import comfy.model_patcher

    from fluxaccel.core.models import synthetic
    from support.shapes import TINY

    conf = synthetic._model_config(synthetic.unet_config(TINY))
    conf.set_inference_dtype(torch.bfloat16, torch.float32)
    bm = conf.get_model({}, device="cpu")
    bm.diffusion_model.to(dtype=torch.bfloat16)
    synthetic.init_random_(bm.diffusion_model, 0)
    base = comfy.model_patcher.ModelPatcher(bm, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    model, compiled = apply_compile(base, CompileConfig(separate_process=False))
    assert compiled.runner.mod_table.modules[0].values.dtype == torch.float32
    out, ref = _sample(model, seed=1, steps=2), _sample(base, seed=1, steps=2)
    assert compiled.runner.mod_table.counts()["rows_from_table"] == 2
    assert rel_err(out, ref) < 1e-3, rel_err(out, ref)


def test_a_modulation_lora_changed_between_runs_that_share_one_sigmas_tensor_is_in_the_table():
    """SamplerCustomAdvanced with one SIGMAS tensor (BasicScheduler's output, cached by ComfyUI) in two prompts, a
    LoRA on the modulation weights at strength 1.0 then 0.5: the table is rebuilt because its weights were written
    (their generations), not because the sigmas changed; each run equals eager ComfyUI's (float32)."""
    import comfy.samplers

    from support.models import lora_state_dict, synthetic_conditioning, with_lora

    base = build_flux("tiny", dtype=torch.float32)
    sd = lora_state_dict(base, ["double_blocks.0.img_mod.lin", "single_blocks.1.modulation.lin"])
    sigmas = comfy.samplers.calculate_sigmas(base.get_model_object("model_sampling"), "simple", 3).cpu()
    latent = torch.zeros(1, 16, 16, 16)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))

    def run(model):  # SamplerCustomAdvanced's sampling: a guider, a sampler, the given sigmas
        guider = comfy.samplers.CFGGuider(model)
        guider.set_conds(synthetic_conditioning("tiny", text_len=16), synthetic_conditioning("tiny", seed=100))
        guider.set_cfg(1.0)
        return guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True, seed=0)

    cfg = CompileConfig(separate_process=False)
    for strength in (1.0, 0.5):
        lora = with_lora(base, sd, strength)
        model, compiled = apply_compile(lora, cfg)
        out = run(model)
        assert rel_err(out, run(lora)) < 1e-4, strength
        assert compiled.runner.mod_table.builds == (1 if strength == 1.0 else 2)
