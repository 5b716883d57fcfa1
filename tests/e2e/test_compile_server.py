"""Compile + CUDA Graph inside a real ComfyUI server (CPU inductor): the shape contract as the user meets it,
and correct results again after /free unloads the model."""
import pytest
import torch
from safetensors.torch import load_file

from core.metrics import rel_err
from tools.comfy_server import PromptFailed

from .conftest import E2E_UNET

pytestmark = pytest.mark.e2e


def _graph(size=64, compile_=True, text_length=16, tag="c", latent_node="EmptySD3LatentImage"):
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": E2E_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "FluxAccelSyntheticConditioning",
              "inputs": {"model": ["1", 0], "text_length": text_length, "guidance": 3.5, "seed": 0}},
        "3": {"class_type": latent_node, "inputs": {"width": size, "height": size, "batch_size": 1}},
        "4": {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0], "cuda_graphs": True, "mode": "default",
                                                           "resolution_policy": "strict", "max_shapes": 4}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["4" if compile_ else "1", 0], "seed": 3, "steps": 2,
                                                   "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                                                   "positive": ["2", 0], "negative": ["2", 0],
                                                   "latent_image": ["3", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": tag}},
    }
    if not compile_:
        del g["4"]
    return g


def _latent(server, hist):
    f = hist["outputs"]["6"]["latents"][0]
    return load_file(str(server.output_dir / f["subfolder"] / f["filename"]))["latent_tensor"]


def test_strict_shapes_and_reload_in_a_server(server):
    server.free()
    eager = _latent(server, server.run(_graph(compile_=False, tag="eager")))
    compiled = _latent(server, server.run(_graph(tag="compiled")))
    assert rel_err(compiled, eager) < 2e-2  # bf16, 2 steps, one compile of the e2e FLUX
    for bad, what in (({"size": 80}, "latent 10x10"), ({"text_length": 24}, "24 text tokens")):
        with pytest.raises(PromptFailed) as exc:
            server.run(_graph(tag="bad", **bad))
        msg = exc.value.exception_message
        assert "compiled for batch 1, latent 8x8 (64x64 px), 16 text tokens" in msg and what in msg
        assert "resolution_policy" in msg
    # After /free unloads the model (ComfyUI keeps its node cache, so the Compile node's output, i.e. the same
    # compiled model, is reused), the sampler runs again on the reloaded weights: a different but equivalent
    # empty-latent node forces the KSampler to re-execute with identical inputs.
    server.free(unload_models=True, free_memory=False)
    again = _latent(server, server.run(_graph(tag="again", latent_node="EmptyLatentImage")))
    assert torch.equal(again, compiled)
