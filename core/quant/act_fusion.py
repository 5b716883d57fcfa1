"""Where a FLUX MLP's activation meets an FP8 Linear, and moving the activation into that Linear's quantization.

A site is an activation module whose output goes, whole, into one FP8 Linear:
  * GELU(tanh) (FLUX.1, Chroma): the double blocks' MLPs (`img_mlp` / `txt_mlp`: Linear, GELU, Linear) and the
    single blocks' `mlp_act`, whose output ComfyUI concatenates after the attention output before `linear2`;
  * FLUX.2's SiLU gate (ComfyUI's `SiLUActivation`: SiLU(m1) * m2 of the first Linear's output [m1 | m2]) in the
    same two places.
Fusing a site puts an Identity in the activation's place (an object patch of the clone, like the FP8 Linears
themselves) and tells the FP8 Linear which activation it now applies and from which input column (`fused_act`,
`act_from`): its forward then runs the activation and the row-wise quantization as one kernel (act_quant.py). For
the SiLU gate the Linear then takes the first Linear's whole output, twice as wide as the gated row.

Each site is fused only where its block's forward is the one read here: a double block calls its MLP as one module
(`self.img_mlp(...)`), a single block applies the activation to the MLP stream and then runs `linear2(torch.cat((attn,
mlp), 2))`, and a SiLU gate's forward is ComfyUI's. A forward written otherwise keeps its activation, and the report
says so.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .act_quant import MAX_ROW
from .linear import is_fp8_linear

SINGLE_FORWARD = ("mlp = self.mlp_act(mlp)", "self.linear2(torch.cat((attn, mlp), 2))")
SILU_GATE_FORWARD = ("x1, x2 = x.chunk(2, dim=-1)", "return self.gate_fn(x1) * x2")
NAMES = {"gelu": "GELU", "silu_gate": "SiLU gate"}


@dataclass(frozen=True)
class ActSite:
    module: str  # the activation module's name (diffusion-model relative)
    linear: str  # the Linear taking its output
    act_from: int  # the Linear's first input column that is the activation's output
    act: str = "gelu"  # "gelu" or "silu_gate"


def _activation(m) -> str | None:
    """"gelu" for GELU(tanh), "silu_gate" for a SiLU gate (a module gating with an nn.SiLU, as ComfyUI's
    SiLUActivation), None for anything else."""
    if isinstance(m, torch.nn.GELU) and m.approximate == "tanh":
        return "gelu"
    if isinstance(getattr(m, "gate_fn", None), torch.nn.SiLU):
        return "silu_gate"
    return None


def gate_forward_known(m: torch.nn.Module) -> bool:
    """Whether a SiLU gate's forward is ComfyUI's SiLUActivation.forward as read (gate_fn of the first half times the
    second)."""
    src = _forward_source(m)
    return all(line in src for line in SILU_GATE_FORWARD)


def _forward_source(module: torch.nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def single_forward_known(block: torch.nn.Module) -> bool:
    """Whether this single block's forward concatenates attention and the activation's output right before linear2,
    as read."""
    src = _forward_source(block)
    return all(line in src for line in SINGLE_FORWARD)


def mlp_called_whole(parent: torch.nn.Module, attr: str) -> bool:
    """Whether the forward of the block holding an MLP calls it as one module (`self.img_mlp(...)`), so that its
    activation runs between its two Linears and nowhere else."""
    src = _forward_source(parent)
    return f"self.{attr}(" in src and f"self.{attr}[" not in src


def _mlp_site(dm, name: str, act: str) -> ActSite | str:
    parent, _, attr = name.rpartition(".")
    if not mlp_called_whole(dm.get_submodule(parent) if parent else dm, attr):
        return "its block's forward does not call the MLP as one module"
    return ActSite(f"{name}.1", f"{name}.2", 0, act)


def _single_site(name: str, block, act: str) -> ActSite | str:
    width = getattr(block, "mlp_hidden_dim", None)
    if getattr(block, "yak_mlp", False) or not isinstance(width, int) or not single_forward_known(block):
        return "its block's forward is not the single block FluxAccel reads"
    return ActSite(f"{name}.mlp_act", f"{name}.linear2", block.linear2.in_features - width, act)


def find_sites(dm: torch.nn.Module, original=lambda name, m: m) -> tuple[list[ActSite], dict[str, tuple[str, str]]]:
    """(the sites of a FLUX diffusion model, {activation name: (its kind, why it is not a site)} for GELU(tanh)s and
    SiLU gates that are not).

    original(name, module): the module as the model is without any clone's object patches (the live tree may hold
    another clone's, e.g. its Identity in an activation's place)."""
    sites, kept = [], {}
    for name, m in dm.named_modules():
        mlp = isinstance(m, torch.nn.Sequential) and len(m) == 3
        if not (mlp or hasattr(m, "linear2")):
            continue
        module = f"{name}.1" if mlp else f"{name}.mlp_act"
        found_module = original(module, m[1] if mlp else getattr(m, "mlp_act", None))
        act = _activation(found_module)
        if act is None:
            continue
        found = _mlp_site(dm, name, act) if mlp else _single_site(name, m, act)
        if act == "silu_gate" and not gate_forward_known(found_module):
            kept[module] = (act, "its forward is not the SiLU gate FluxAccel reads")
        elif isinstance(found, str):
            kept[module] = (act, found)
        elif dm.get_submodule(found.linear).in_features > MAX_ROW:
            kept[module] = (act, f"its Linear's rows are wider than {MAX_ROW} (the one-pass kernel holds a row in "
                                 f"registers)")
        else:
            sites.append(found)
    return sites, kept



def fuse(dm: torch.nn.Module, original, fp8: dict[str, torch.nn.Module], cfg, report) -> dict[str, torch.nn.Module]:
    """Move each site's activation into the FP8 Linear after it (`fp8`: the new Linears by diffusion-model name, as
    build.py made them): their object patches, {activation key: Identity}. The report says how many, per kind, and
    why any was kept. original(name, module): as find_sites."""
    sites, kept = find_sites(dm, original)
    identities = {}
    for act in ("gelu", "silu_gate"):
        mine = [site for site in sites if site.act == act]
        kept_here = {name: why for name, (kind, why) in kept.items() if kind == act}
        why = cfg.fusion_unavailable(act) if mine else ""
        line = f"MLP {NAMES[act]} kept separate: {why}" if why else _fuse_kind(act, mine, kept_here, fp8, identities)
        if act == "gelu":
            report.gelu = line
        elif mine or kept_here:  # FLUX.2's line; FLUX.1's report has none
            report.silu_gate = line
    return identities


def _fuse_kind(act: str, sites: list[ActSite], kept: dict[str, str], fp8: dict, identities: dict) -> str:
    """Fuse the sites of one activation kind, adding their Identities; the report's line."""
    fused = 0
    for site in sites:
        q = fp8.get(site.linear)
        if q is None or not is_fp8_linear(q) or q.fp8_act_kwargs.float8_dtype != torch.float8_e4m3fn:
            kept[site.module] = "the Linear after it is not quantized to float8_e4m3fn"
            continue
        q.fused_act, q.act_from = act, site.act_from
        identities[f"diffusion_model.{site.module}"] = torch.nn.Identity()
        fused += 1
    if not (fused or kept):
        return f"no {'GELU(tanh)' if act == 'gelu' else 'SiLU-gated'} MLP in this model to fuse"
    line = (f"MLP {NAMES[act]} fused into the FP8 quantization of the next Linear (one pass) at {fused} of "
            f"{fused + len(kept)} {NAMES[act]}s")
    if kept:
        line += f"; kept separate ({len(kept)}): {'; '.join(sorted(set(kept.values())))}"
    return line
