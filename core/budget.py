"""What a model call of a given size needs in memory, against what the device (or host RAM) has free: checked before
FluxAccel allocates anything that grows with an input, so that a size typed into a node is refused with a message
naming the node, the input and the limit, rather than growing the server until the system stops it."""
from __future__ import annotations

import logging

import torch

from .errors import FluxAccelError

log = logging.getLogger("fluxaccel.budget")

ACTIVATION_WIDTHS = 24  # live hidden-width activations per token at a FLUX block's peak (QKV, MLP x4, residuals)


def call_bytes(dm: torch.nn.Module, tokens: int, batch: int, itemsize: int, device: torch.device) -> int:
    """An estimate of one FLUX model call's peak activation memory: the blocks' activations, and on a CPU (where
    attention may take PyTorch's math path) the attention scores of one head batch."""
    hidden = int(getattr(getattr(dm, "params", None), "hidden_size", 0) or dm.img_in.out_features)
    heads = int(getattr(dm, "num_heads", 1))
    need = batch * tokens * hidden * itemsize * ACTIVATION_WIDTHS
    if torch.device(device).type == "cpu":
        need += batch * heads * tokens * tokens * 4
    return need


def call_tokens(width: int, height: int, text_tokens: int, token_px: int, references=()) -> int:
    """The tokens of one FLUX model call at this image size (pixels; `token_px` pixels per token side: models.flux's
    token_px), its text and its reference images ((width, height) pixels each)."""
    px = token_px ** 2
    return (height * width) // px + text_tokens + sum(rw * rh for rw, rh in references) // px


def text_tokens(model, context: torch.Tensor) -> int:
    """The text length the diffusion model is called with for this conditioning (a ComfyUI MODEL): ComfyUI's own
    extra_conds decide (its FLUX.2 pads the text to 512 tokens)."""
    latent = torch.zeros(1, model.model.latent_format.latent_channels, 8, 8)
    try:
        conds = model.model.extra_conds(cross_attn=context, noise=latent, device=torch.device("cpu"))
        return int(conds["c_crossattn"].cond.shape[1])
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:  # a model whose conditioning we cannot replay
        log.warning("FluxAccel: cannot tell how ComfyUI passes this text to the model (%s: %s); counting %d text "
                    "tokens as given", type(e).__name__, e, context.shape[1])
        return int(context.shape[1])


def require_call_room(node: str, what: str, model, width: int, height: int, batch: int, text_tokens: int,
                      references=()) -> None:
    """Refuse a model call of this size (a ComfyUI MODEL; batch as the model is called: cond and uncond together
    above cfg 1) that does not fit what its load device has free."""
    from .models.flux import latent_scale, token_px

    bm = model.model
    dtype = bm.manual_cast_dtype or bm.get_dtype()
    device = torch.device(model.load_device)
    tokens = call_tokens(width, height, text_tokens, token_px(bm.diffusion_model, latent_scale(model)), references)
    require_room(node, what, call_bytes(bm.diffusion_model, tokens, batch, dtype.itemsize, device), device)


def require_room(node: str, what: str, need: int, device: torch.device) -> None:
    """Refuse, naming the node and the input, what needs more than the device has free (ComfyUI's own figure: the
    GPU's free memory, or the host's available RAM)."""
    from comfy import model_management as mm

    free = mm.get_free_memory(torch.device(device))
    if need > free:
        raise FluxAccelError(f"{node}: {what} needs about {need / 1024**3:.1f} GiB on {device}, which has "
                             f"{free / 1024**3:.1f} GiB free; use a smaller size or batch")
