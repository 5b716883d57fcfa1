"""Where FLUX's MLP GELU meets an FP8 Linear, and moving the GELU into that Linear's activation quantization.

A site is a GELU(tanh) module whose output goes, whole, into one FP8 Linear: the double blocks' MLPs
(`img_mlp` / `txt_mlp`: Linear, GELU, Linear) and the single blocks' `mlp_act`, whose output ComfyUI concatenates
after the attention output before `linear2`. Fusing a site puts an Identity in the GELU's place (an object patch
of the clone, like the FP8 Linears themselves) and gives the FP8 Linear the first input column GELU applies to
(`gelu_from`): its forward then runs GELU and the row-wise quantization as one kernel (act_quant.py).

Each site is fused only where its block's forward is the one read here: a double block calls its MLP as one module
(`self.img_mlp(...)`), a single block applies GELU to the MLP stream and then runs `linear2(torch.cat((attn, mlp),
2))`. A forward written otherwise keeps its GELU, and the report says so.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .act_quant import MAX_ROW

GELU_SINGLE_FORWARD = ("mlp = self.mlp_act(mlp)", "self.linear2(torch.cat((attn, mlp), 2))")


@dataclass(frozen=True)
class GeluSite:
    gelu: str  # the GELU module's name (diffusion-model relative)
    linear: str  # the Linear taking its output
    gelu_from: int  # the Linear's first input column that is GELU's output


def _is_tanh_gelu(m) -> bool:
    return isinstance(m, torch.nn.GELU) and m.approximate == "tanh"


def _forward_source(module: torch.nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def single_forward_known(block: torch.nn.Module) -> bool:
    """Whether this single block's forward concatenates attention and GELU's output right before linear2, as read."""
    src = _forward_source(block)
    return all(line in src for line in GELU_SINGLE_FORWARD)


def mlp_called_whole(parent: torch.nn.Module, attr: str) -> bool:
    """Whether the forward of the block holding an MLP calls it as one module (`self.img_mlp(...)`), so that its GELU
    runs between its two Linears and nowhere else."""
    src = _forward_source(parent)
    return f"self.{attr}(" in src and f"self.{attr}[" not in src


def find_sites(dm: torch.nn.Module, original=lambda name, m: m) -> tuple[list[GeluSite], dict[str, str]]:
    """(the sites of a FLUX diffusion model, {GELU name: why it is not a site} for GELU(tanh)s that are not).

    original(name, module): the module as the model is without any clone's object patches (the live tree may hold
    another clone's, e.g. its Identity in a GELU's place)."""
    sites, kept = [], {}
    for name, m in dm.named_modules():
        if isinstance(m, torch.nn.Sequential) and len(m) == 3 and _is_tanh_gelu(original(f"{name}.1", m[1])):
            parent, _, attr = name.rpartition(".")
            if mlp_called_whole(dm.get_submodule(parent) if parent else dm, attr):
                sites.append(GeluSite(f"{name}.1", f"{name}.2", 0))
            else:
                kept[f"{name}.1"] = "its block's forward does not call the MLP as one module"
        elif _is_tanh_gelu(original(f"{name}.mlp_act", getattr(m, "mlp_act", None))) and \
                hasattr(m, "linear2"):
            width = getattr(m, "mlp_hidden_dim", None)
            if getattr(m, "yak_mlp", False) or not isinstance(width, int) or not single_forward_known(m):
                kept[f"{name}.mlp_act"] = "its block's forward is not the single block FluxAccel reads"
            else:
                sites.append(GeluSite(f"{name}.mlp_act", f"{name}.linear2", m.linear2.in_features - width))
    for site in list(sites):
        if dm.get_submodule(site.linear).in_features > MAX_ROW:
            sites.remove(site)
            kept[site.gelu] = (f"its Linear's rows are wider than {MAX_ROW} (the one-pass kernel holds a row in "
                               f"registers)")
    return sites, kept
