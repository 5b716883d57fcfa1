"""LoRA and FluxAccel in a real ComfyUI server (LoraLoaderModelOnly with a LoRA file): before Quantize FP8 it is
merged into the FP8 weights and matches the eager LoRA'd model within FP8 tolerance; its strength takes effect;
after Quantize FP8 it is merged the same way."""
import pytest
import torch

from tools.comfy_server import PromptFailed

from .conftest import MODELS_DIR, flux_inputs, sample_and_save, saved_latent
from fluxaccel.core.bench.metrics import rel_err

pytestmark = pytest.mark.e2e

LORA = "fluxaccel-test-lora.safetensors"
TARGETS = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_mlp.0", "single_blocks.0.linear1",
           "single_blocks.0.linear2"]
FP8_TOL = 0.08  # FP8 e4m3 on the whole model, as in tests/core/quant/test_quant_patch.py


@pytest.fixture(scope="module")
def lora_file(e2e_model_file):
    from support.models import write_lora_file

    return write_lora_file(MODELS_DIR / "loras" / LORA, e2e_model_file, TARGETS)


def _prompt(order: list[str], strength: float = 1.0, seed: int = 3) -> dict:
    """UNETLoader -> the nodes in `order` ('lora', 'fp8') -> KSampler -> SaveLatent."""
    g = flux_inputs()
    prev = "1"
    for i, kind in enumerate(order):
        nid = str(10 + i)
        if kind == "lora":
            g[nid] = {"class_type": "LoraLoaderModelOnly",
                      "inputs": {"model": [prev, 0], "lora_name": LORA, "strength_model": strength}}
        else:
            g[nid] = {"class_type": "FluxAccelQuantizeFP8",
                      "inputs": {"model": [prev, 0], "granularity": "per_row", "scope": "blocks"}}
        prev = nid
    g.update(sample_and_save(prev, seed=seed, steps=1, tag="-".join(order) or "plain"))
    return g


_err = rel_err


def test_lora_before_fp8_is_merged_and_strength_takes_effect(server, lora_file):
    run = lambda order, strength=1.0: saved_latent(server, server.run(_prompt(order, strength)))  # noqa: E731
    plain, fp8 = run([]), run(["fp8"])
    lora, lora_fp8 = run(["lora"]), run(["lora", "fp8"])
    assert _err(lora, plain) > 0.3, "the test LoRA must change the result clearly"
    assert _err(lora_fp8, lora) < FP8_TOL, f"LoRA then FP8 vs eager LoRA: {_err(lora_fp8, lora):.4f}"
    assert _err(lora_fp8, fp8) > 4 * _err(lora_fp8, lora), "the LoRA must not be ignored under FP8"
    half, half_fp8 = run(["lora"], 0.5), run(["lora", "fp8"], 0.5)
    assert _err(half_fp8, half) < FP8_TOL
    assert _err(half_fp8, lora_fp8) > 4 * _err(half_fp8, half), "a new LoRA strength must take effect"


def test_lora_after_fp8_is_merged_like_a_lora_before_it(server, lora_file):
    """LoraLoaderModelOnly after Quantize FP8 (a real server, the real LoRA node): the same latent as the LoRA placed
    before it, and the plain FP8 workflow gives its own latent again after it."""
    run = lambda order, strength=1.0: saved_latent(server, server.run(_prompt(order, strength, seed=4)))  # noqa: E731
    fp8 = run(["fp8"])
    after, before = run(["fp8", "lora"]), run(["lora", "fp8"])
    assert torch.equal(after, before) and _err(after, fp8) > 0.1
    assert torch.equal(run(["fp8"]), fp8)
