"""What a model call of a given size needs in memory, against what the device (or host RAM) has free: checked before
FluxAccel allocates anything that grows with an input, so that a size typed into a node is refused with a message
naming the node, the input and the limit, rather than growing the server until the system stops it."""
from __future__ import annotations

import torch

from .errors import FluxAccelError

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


def require_room(node: str, what: str, need: int, device: torch.device) -> None:
    """Refuse, naming the node and the input, what needs more than the device has free (ComfyUI's own figure: the
    GPU's free memory, or the host's available RAM)."""
    from comfy import model_management as mm

    free = mm.get_free_memory(torch.device(device))
    if need > free:
        raise FluxAccelError(f"{node}: {what} needs about {need / 1024**3:.1f} GiB on {device}, which has "
                             f"{free / 1024**3:.1f} GiB free; use a smaller size or batch")
