"""Quantize FP8 inside a real ComfyUI execution: the FP8 branch runs FP8, a branch using the same loaded
model without our node computes exactly what it computes when our node is absent."""
import pytest
import torch
from safetensors.torch import load_file

from core.metrics import rel_err
from tools.comfy_server import PromptFailed

from .conftest import E2E_UNET

pytestmark = pytest.mark.e2e
SEED, STEPS = 7, 2


def _graph(fp8: bool, plain: bool, granularity="per_row", weight_dtype="default", tag=""):
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": E2E_UNET, "weight_dtype": weight_dtype}},
        "2": {"class_type": "FluxAccelSyntheticConditioning",
              "inputs": {"model": ["1", 0], "text_length": 16, "guidance": 3.5, "seed": 0}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    }
    sampler = {"seed": SEED, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
               "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0], "denoise": 1.0}
    if plain:
        g["10"] = {"class_type": "KSampler", "inputs": {"model": ["1", 0], **sampler}}
        g["11"] = {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": f"plain{tag}"}}
    if fp8:
        g["20"] = {"class_type": "FluxAccelQuantizeFP8",
                   "inputs": {"model": ["1", 0], "granularity": granularity, "scope": "blocks"}}
        g["21"] = {"class_type": "KSampler", "inputs": {"model": ["20", 0], **sampler}}
        g["22"] = {"class_type": "SaveLatent", "inputs": {"samples": ["21", 0], "filename_prefix": f"fp8{tag}"}}
    return g


def _latent(server, hist, node):
    f = hist["outputs"][node]["latents"][0]
    return load_file(str(server.output_dir / f["subfolder"] / f["filename"]))["latent_tensor"]


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
