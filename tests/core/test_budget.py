"""core/budget.py against real ComfyUI models: the text length a call gets (ComfyUI's own extra_conds), a call's
tokens, and a call refused by the room its load device has free (ComfyUI's own figure)."""
import pytest
import torch

from fluxaccel.core import budget
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.models.synthetic import synthetic_conditioning_for
from support.models import build_flux
from support.shapes import TINY, TINY_FLUX2


@pytest.mark.parametrize("shape, called_with", [(TINY, 16), (TINY_FLUX2, 512)])
def test_text_tokens_are_what_comfyui_calls_the_model_with(shape, called_with):
    """FLUX.1 gets its text as it comes; ComfyUI's FLUX.2 pads it to 512 tokens."""
    model = build_flux(shape)
    context = synthetic_conditioning_for(model.model.diffusion_model, 16)[0][0]
    assert budget.text_tokens(model, context) == called_with


def test_text_tokens_of_a_model_whose_conditioning_cannot_be_replayed_are_counted_as_given(monkeypatch, caplog):
    model = build_flux(TINY_FLUX2)
    context = synthetic_conditioning_for(model.model.diffusion_model, 16)[0][0]
    # an upstream whose extra_conds takes other arguments
    monkeypatch.setattr(model.model, "extra_conds", lambda noise, device, **other: {})
    with caplog.at_level("WARNING", "fluxaccel.budget"):
        assert budget.text_tokens(model, context) == 16
    assert "cannot tell how ComfyUI passes this text to the model" in caplog.text


@pytest.mark.parametrize("shape", [TINY, TINY_FLUX2])
def test_a_token_is_16_pixels_square_in_each_architecture(shape):
    """FLUX.1 packs 2x2 cells of its 8x latent into a token, FLUX.2 takes one cell of its 16x latent: 1024x512 px is
    64x32 tokens in both, as the model's own patchify makes them."""
    from fluxaccel.core.models.flux import latent_scale, token_px
    from support.runs import denoise_once

    model = build_flux(shape)
    dm = model.model.diffusion_model
    px = token_px(dm, latent_scale(model))
    assert px == 16 and budget.call_tokens(1024, 512, 7, px, [(256, 128)]) == 64 * 32 + 7 + 16 * 8
    seen = []
    handle = dm.img_in.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        denoise_once(model, hw=512 // latent_scale(model), w=1024 // latent_scale(model))
    finally:
        handle.remove()
    assert seen == [64 * 32]


def test_a_call_larger_than_the_free_memory_is_refused_naming_the_node_and_the_input():
    """The padded text counts: FLUX.2 at 64x64 px is 16 image tokens and 512 text tokens. A size whose attention
    alone needs more than this machine has free is refused; one that fits passes."""
    import comfy.model_management as mm

    model = build_flux(TINY_FLUX2)
    text = budget.text_tokens(model, synthetic_conditioning_for(model.model.diffusion_model, 16)[0][0])
    assert budget.call_tokens(64, 64, text, 16) == 16 + 512
    budget.require_call_room("Node", "width", model, 64, 64, 1, text)
    free = mm.get_free_memory(torch.device("cpu"))
    side = 64
    while budget.call_bytes(model.model.diffusion_model, budget.call_tokens(side, side, text, 16), 1, 4, "cpu") <= free:
        side *= 2
    with pytest.raises(FluxAccelError, match=rf"Node: width needs about [\d.]+ GiB on cpu, which has [\d.]+ GiB free; "
                                             r"use a smaller size or batch"):
        budget.require_call_room("Node", "width", model, side, side, 1, text)
