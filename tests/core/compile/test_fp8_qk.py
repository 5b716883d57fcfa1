"""core/compile/fp8_qk.py: FP8 attention's Q and K made from a single block's QKV projection in one kernel.

What is checked: the operator's numbers are ComfyUI's QK-norm and RoPE cast as FP8 attention casts them (on a real
ComfyUI block); the Triton kernel, run by Triton's CPU interpreter, computes them within the interpreter's bf16
truncations, V's absmax exactly; FluxAccel's single-block forward calls it under FP8 attention and gives the usual
way's output bit for bit; what stops it is named and said once; the compile cache keeps the graphs apart.
"""
import logging
import os
import subprocess
import sys
from pathlib import Path

import comfy.ldm.flux.math as flux_math
import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs

from conftest import COMFY_VERSION
from fluxaccel.core.compile import block_regions, fp8_attention as fa, fp8_qk, single_block
from fluxaccel.core.compile.attention import OVERRIDE_KEY
from fluxaccel.core.compile.block_regions import BlockRegions
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.kernel_cache import cache_key
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support import fa3_standin
from support.runs import flux_inputs

ROOT = Path(__file__).resolve().parents[3]
READ = COMFY_VERSION == "0.33.0"  # the ComfyUI whose attention function the kernel stands in for


@pytest.fixture
def fa3():
    fa3_standin.register()
    fa3_standin.CALLS.clear()
    yield fa3_standin.CALLS


def _block_inputs(dm, n=24, seed=0):
    """A single block's QKV projection (a strided slice, as the block's split makes it) and FLUX's rotations."""
    g = torch.Generator().manual_seed(seed)
    hidden = dm.hidden_size
    full = (torch.randn(1, n, 3 * hidden + 64, generator=g) * 3).to(torch.bfloat16)
    ids = torch.zeros(1, n, 3)
    ids[0, :, 1], ids[0, :, 2] = torch.arange(n) // 4, torch.arange(n) % 4
    return full[..., :3 * hidden], dm.pe_embedder(ids)


def test_the_operator_is_comfyuis_q_and_k_cast_as_fp8_attention_casts_them(tiny_flux):
    """ComfyUI's own path on a real single block (its QKNorm, ComfyUI's RoPE formula, fp8_attention's cast) and the
    operator agree bit for bit; V's absmax is V's."""
    dm = tiny_flux.model.diffusion_model
    block = dm.single_blocks[0]
    qkv, pe = _block_inputs(dm)
    scales = fa.qk_scales(block)
    q, k, v = qkv.view(1, qkv.shape[1], 3, block.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = block.norm(q, k, v)
    q, k = flux_math._apply_rope1(q, pe), flux_math._apply_rope1(k, pe)
    eps = torch.finfo(torch.float32).eps  # torch.nn.RMSNorm's eps None: float32's, in which rms_norm computes
    q8, k8, vmax = fp8_qk.qk_norm_rope_fp8(qkv, block.norm.query_norm.weight, block.norm.key_norm.weight, pe, scales,
                                           block.num_heads, eps)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and q8.shape == (1, qkv.shape[1], block.num_heads, 128)
    assert torch.equal(q8.float(), fa._fp8(q, scales[0]).float())
    assert torch.equal(k8.float(), fa._fp8(k, scales[1]).float())
    assert vmax.dtype == torch.float32 and float(vmax) == float(v.abs().amax())


_INTERPRETED = r"""
import sys, torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from tools.plugin import register
register()
from fluxaccel.core.compile import fp8_qk
g = torch.Generator().manual_seed(1)
b, n, H, D = 2, 6, 3, 16  # 3 heads: the kernel's head block (4) masks one
qkv = (torch.randn(b, n, 3 * H * D + 20, generator=g) * 2).to(torch.bfloat16)[..., :3 * H * D]  # strided rows
wq, wk = ((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2))
ang = torch.rand(1, 1, n, D // 2, generator=g) * 6  # one set of rotations for both batch rows
pe = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, 1, n, D // 2, 2, 2)
scales, eps = torch.tensor([0.01, 0.02]), 2 ** -7
q, k = torch.empty(b, n, H, D), torch.empty(b, n, H, D)  # float32 outputs: the kernel's values before the e4m3 cast
vmax = torch.zeros(1)
fp8_qk._kernel()[(n, b)](qkv, wq, wk, pe, scales, q, k, vmax, qkv.stride(0), qkv.stride(1), 0, pe.stride(2),
                         q.stride(0), q.stride(1), 0, H, eps, HEAD_DIM=D, BLOCK_H=4, BLOCK_V=64)
x = qkv.reshape(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
out = {"vmax": (float(vmax), float(x[2].abs().amax()))}
for name, got, t, w, s in (("q", q, x[0], wq, scales[0]), ("k", k, x[1], wk, scales[1])):
    want = (fp8_qk.rope(F.rms_norm(t, (D,), w, eps), pe).float() / s).clamp(-448, 448).transpose(1, 2)
    head_max = want.abs().amax(-1, keepdim=True)
    out[name] = float(((got - want).abs() / head_max).max())
print(out)
"""


def test_the_triton_kernel_in_tritons_interpreter_matches_the_reference(tmp_path):
    """The GPU kernel run by Triton's CPU interpreter (two batch rows sharing one set of rotations, strided QKV rows,
    a masked head), writing values before the e4m3 cast: each within the interpreter's bf16 truncations of the
    reference (the norm's output, then RoPE's: a few 2^-7 of the head's largest value; a wrong pair, head, weight or
    rotation is off by far more); V's absmax exact. The GPU's own rounding is compared in
    bench/probes/fp8_qk.py."""
    pytest.importorskip("triton")
    script = tmp_path / "interpreted.py"
    script.write_text(_INTERPRETED)
    done = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (our own script's printed dict)
    assert result["vmax"][0] == result["vmax"][1]
    assert result["q"] < 4 * 2 ** -7 and result["k"] < 4 * 2 ** -7, result


def _loaded(model):
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    return model.model.diffusion_model


def _ops_called(gm) -> set:
    found = set()
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            found |= {str(n.target) for n in mod.graph.nodes if n.op == "call_function"}
    return found


@pytest.mark.skipif(not READ, reason="the attention function FluxAccel read is ComfyUI 0.33.0's")
def test_single_blocks_under_fp8_attention_call_it_and_give_the_usual_output(cpu_fp8, tiny_flux, fa3, fresh_dynamo):
    """Traced through the regions with FP8 attention: the graph calls the operator (once per single block), every
    attention runs the FP8 kernel, and the output equals the usual way's (the regions without it) exactly."""
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    x, t, ctx, y, guidance = flux_inputs(dm)
    outs, ops = {}, {}
    for with_kernel in (True, False):
        torch._dynamo.reset()
        rec = EagerAndRecordGraphs()
        options = {**BlockRegions(dm, "fluxaccel", fp8_attention=with_kernel).transformer_options(),
                   OVERRIDE_KEY: fa.sdpa_fp8}
        fa3.clear()
        outs[with_kernel] = torch.compile(dm, backend=rec, fullgraph=True, dynamic=False)(
            x, t, context=ctx, y=y, guidance=guidance, transformer_options=options)
        assert len(fa3) == len(dm.double_blocks) + len(dm.single_blocks)
        ops[with_kernel] = _ops_called(rec.graphs[0])
    assert "fluxaccel.qk_norm_rope_fp8.default" in ops[True]
    assert "fluxaccel.qk_norm_rope_fp8.default" not in ops[False]
    assert torch.equal(outs[True], outs[False])


@pytest.mark.skipif(not READ, reason="the attention function FluxAccel read is ComfyUI 0.33.0's")
def test_a_mask_or_an_attention_patch_goes_the_usual_way(tiny_flux):
    dm = tiny_flux.model.diffusion_model
    block = dm.single_blocks[0]
    qkv, pe = _block_inputs(dm)
    options = {fa.SCALES_KEY: fa.qk_scales(block), OVERRIDE_KEY: fa.sdpa_fp8}
    assert fp8_qk.takes(block, qkv, pe, None, {}, options)
    assert not fp8_qk.takes(block, qkv, pe, torch.ones(1, 1), {}, options)
    assert not fp8_qk.takes(block, qkv, pe, None, {"attn1_patch": [lambda *a, **k: {}]}, options)
    assert not fp8_qk.takes(block, qkv, pe, None, {}, {**options, fa.SCALES_KEY: None})  # Q/K scales per call
    assert not fp8_qk.takes(block, qkv, pe, None, {}, {fa.SCALES_KEY: fa.qk_scales(block)})  # not FP8 attention
    assert not fp8_qk.takes(block, qkv, pe[..., 0], None, {}, options)  # not FLUX's rotations


def test_why_not_names_what_stops_it(tiny_flux, monkeypatch):
    block = tiny_flux.model.diffusion_model.single_blocks[0]
    if READ:
        assert fp8_qk.why_not(block, flux_math.attention) == ""
    assert fp8_qk.why_not(block, lambda q: q).endswith(".attention is not the one FluxAccel read")
    monkeypatch.setattr(fp8_qk, "KNOWN_ATTENTION", {fp8_qk.source_hash(flux_math.attention): "here"})
    block.norm.key_norm.weight_function = [lambda w: w * 2]  # ComfyUI changes the weight per call (LoRA on the fly)
    assert fp8_qk.why_not(block, flux_math.attention) == "the block's QK-norm is not a plain RMSNorm FluxAccel can read"
    block.norm.key_norm.weight_function = []
    monkeypatch.setattr(fp8_qk, "_OP", None)
    monkeypatch.setattr(fp8_qk, "UNAVAILABLE", "Triton is not installed (the fused kernel is a Triton kernel)")
    assert fp8_qk.why_not(block, flux_math.attention) == fp8_qk.UNAVAILABLE
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        fp8_qk.qk_norm_rope_fp8(*_block_inputs(tiny_flux.model.diffusion_model), None, None, None, 2, 1e-6)


@pytest.mark.skipif(not READ, reason="FluxAccel's single-block forward is ComfyUI 0.33.0's")
def test_the_regions_say_once_why_single_blocks_go_the_usual_way(cpu_fp8, tiny_flux, monkeypatch, caplog):
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    monkeypatch.setattr(fp8_qk, "KNOWN_ATTENTION", {})
    monkeypatch.setattr(block_regions, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="fluxaccel.compile"):
        assert BlockRegions(dm, "fluxaccel", fp8_attention=True).table()
        BlockRegions(dm, "fluxaccel", fp8_attention=True).table()
        BlockRegions(dm, "fluxaccel").table()  # FP8 attention off: nothing to say
    said = [r.getMessage() for r in caplog.records if "Q/K norm, RoPE and casts" in r.getMessage()]
    assert said == ["FluxAccel: FP8 attention's Q/K norm, RoPE and casts run as separate kernels in the single blocks "
                    "(same numbers): comfy.ldm.flux.math.attention is not the one FluxAccel read"]
    assert single_block.fused_qk_why_not(dm.single_blocks[0]) != ""


def test_the_compile_cache_keeps_graphs_with_and_without_the_kernel_apart(tiny_flux, monkeypatch):
    dm = tiny_flux.model.diffusion_model
    fp8, cudnn = CompileConfig(attention="fp8", persistent_cache=False), CompileConfig(persistent_cache=False)
    before = {cfg: cache_key(dm, cfg, torch.device("cpu")) for cfg in (fp8, cudnn)}
    monkeypatch.setattr(fp8_qk, "KEY", "fp8-qk-kernel-2")  # the kernel changed
    assert cache_key(dm, fp8, torch.device("cpu")) != before[fp8]
    assert cache_key(dm, cudnn, torch.device("cpu")) == before[cudnn]  # graphs without it keep their key
