"""Quantize FP8 inside a real ComfyUI execution: the FP8 branch runs FP8, a branch using the same loaded
model without our node computes exactly what it computes when our node is absent."""
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from tools.comfy_server import PromptFailed

from .conftest import flux_inputs, sample_and_save, saved_latent as _latent

pytestmark = pytest.mark.e2e
SEED, STEPS = 7, 2


def _graph(fp8: bool, plain: bool, granularity="per_row", weight_dtype="default", tag=""):
    g = flux_inputs(weight_dtype=weight_dtype)
    if plain:
        g.update(sample_and_save("1", SEED, STEPS, f"plain{tag}", ksampler="10", save="11"))
    if fp8:
        g["20"] = {"class_type": "FluxAccelQuantizeFP8",
                   "inputs": {"model": ["1", 0], "granularity": granularity, "scope": "blocks"}}
        g.update(sample_and_save("20", SEED, STEPS, f"fp8{tag}", ksampler="21", save="22"))
    return g


def test_fp8_branch_and_plain_branch_share_one_loaded_model(server):
    server.free()
    ref = _latent(server, server.run(_graph(fp8=False, plain=True, tag="ref")), "11")
    server.free()  # drop ComfyUI's caches so the plain KSampler below really runs again
    hist = server.run(_graph(fp8=True, plain=True, tag="both"))
    plain, fp8 = _latent(server, hist, "11"), _latent(server, hist, "22")
    assert torch.equal(plain, ref), "the plain branch must compute with the original bf16 weights"
    e = rel_err(fp8, ref)
    # 2 euler steps of a 1+1-block FLUX: FP8 moves the latent, by a few percent (bound: see tests/core)
    assert 0 < e < 0.1, e
    text = hist["outputs"]["20"]["text"][0]
    assert "quantized 10 of" in text and "saved" in text
    # Another prompt reusing the loaded model without our node, after the FP8 one: still the original.
    server.free(unload_models=False, free_memory=True)
    again = _latent(server, server.run(_graph(fp8=False, plain=True, tag="after")), "11")
    assert torch.equal(again, ref)


def test_fp8_weight_dtype_is_refused_and_server_keeps_working(server):
    with pytest.raises(PromptFailed) as exc:
        server.run(_graph(fp8=True, plain=False, weight_dtype="fp8_e4m3fn", tag="bad"))
    assert "already stored in reduced precision" in exc.value.exception_message
    assert "weight_dtype 'default'" in exc.value.exception_message
    hist = server.run(_graph(fp8=True, plain=False, granularity="per_tensor", tag="good"))
    assert "FP8 per_tensor" in hist["outputs"]["20"]["text"][0]


def test_plain_and_fp8_prompts_alternating_six_times(server):
    """One loaded model, prompts alternating between a plain branch and an FP8 branch: each result equals its
    branch's reference every time (ComfyUI swaps the FP8 modules in and the originals back on each switch). ComfyUI's
    caches are dropped first: another test's last prompt may have held the same plain branch."""
    server.free()
    refs = {}
    for i in range(6):
        fp8 = i % 2 == 1
        hist = server.run(_graph(fp8=fp8, plain=not fp8, tag=f"alt{i}"))
        cached = server.cached_nodes(hist)
        ks, save = ("21", "22") if fp8 else ("10", "11")
        assert ks not in cached, f"prompt {i}: the KSampler must run, not come from ComfyUI's cache"
        out = _latent(server, hist, save)
        if fp8 not in refs:
            refs[fp8] = out
        assert torch.equal(out, refs[fp8]), f"prompt {i} ({'FP8' if fp8 else 'plain'}) differs from its reference"
    assert 0 < rel_err(refs[True], refs[False]) < 0.1
