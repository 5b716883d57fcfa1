"""Module-level FP8: apply quantized Linears to a ComfyUI ModelPatcher clone through object patches.

Why object patches on a clone:
  * the loaded model (and every other branch or workflow using it) keeps its bf16 Linears; ComfyUI swaps our
    FP8 modules in when our clone is loaded and restores the originals when another clone is loaded;
  * the clone gets its own patches_uuid, so switching between it and a plain clone makes ComfyUI unpatch and
    move the model: only the modules in the live tree go to the GPU, i.e. the FP8 copies, not FP8 + bf16.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from comfy.patcher_extension import WrappersMP

from ..upstream import Unavailable, comfy_internals
from ..models.loaded import (checkpoint_format, is_checkpoint_quantized, linear_like, require_compatible,
                           resident)
from ..env import require_fp8_device, require_torch, require_torchao
from ..errors import FluxAccelError
from ..models import swaps
from ..models.flux import (on_load_callback_type, partial_load_guard, profile, require_bf16_weights, require_flux,
                           require_fully_loaded)
from .fp8 import Fp8Config, linear_weight_bytes, select_linears
from ..cache import fp8_weights
from . import act_fusion
from .linear import detached_copy, is_fp8_linear, plain_from_parts, quantize_linear

log = logging.getLogger("fluxaccel.fp8")

FP8_KEY = "fluxaccel_fp8"  # ModelPatcher attachment (Fp8State), ON_LOAD callback key
NODE = "Quantize FP8 (FluxAccel)"


@dataclass
class Fp8Report:
    granularity: str
    scope: str
    device: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    already_applied: bool = False
    merged_patches: list[str] = field(default_factory=list)  # weight patches (LoRA, ...) merged before quantizing
    # a checkpoint already quantized by ComfyUI's mixed-precision ops (scaled FP8, ...): its format -> how many of the
    # quantized Linears were re-quantized from their dequantized weights; and those outside the scope, now bf16
    requantized: dict[str, int] = field(default_factory=dict)
    dequantized: list[str] = field(default_factory=list)
    weights_cache: str = ""  # loaded from / saved to the FP8 weights cache, or why not cached
    gelu: str = ""  # the MLP GELUs fused into the FP8 quantization, or why not (act_fusion.py)
    silu_gate: str = ""  # the same for FLUX.2's SiLU-gated MLPs (only where the model has them)
    fp8_home: str = ""  # where the FP8 copies wait for ComfyUI's load (GPU or host RAM)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def summary(self) -> str:
        if self.already_applied:
            head = f"FP8 {self.granularity}/{self.scope} already applied to this model: nothing done."
        else:
            head = f"FP8 {self.granularity}, scope {self.scope}, on {self.device}:"
        gib = 1024**3
        lines = [
            head,
            f"quantized {len(self.quantized)} of {len(self.quantized) + len(self.skipped)} Linear layers; "
            f"weights {self.bytes_before / gib:.3f} GiB -> {self.bytes_after / gib:.3f} GiB "
            + (f"(saved {self.bytes_saved / gib:.3f} GiB, {self.bytes_saved} bytes)" if self.bytes_saved >= 0 else
               f"(+{-self.bytes_saved / gib:.3f} GiB: the checkpoint-quantized layers outside the scope are bf16 now)"),
        ]
        lines += [line for line in (self.gelu, self.silu_gate) if line]
        if self.weights_cache:
            lines.append(f"FP8 weights cache: {self.weights_cache}")
        if self.fp8_home:
            lines.append(f"FP8 weights wait {self.fp8_home}")
        if self.merged_patches:
            lines.append(f"merged {len(self.merged_patches)} weight patches (LoRA etc.) into the FP8 weights")
        for fmt, n in sorted(self.requantized.items()):
            lines.append(f"checkpoint already quantized ({fmt}): {n} layers re-quantized {self.granularity} from "
                         f"their dequantized weights (not reused: torchao's {self.granularity} scales differ)")
        if self.dequantized:
            shown = ", ".join(self.dequantized[:6]) + (f", ... (+{len(self.dequantized) - 6})"
                                                       if len(self.dequantized) > 6 else "")
            lines.append(f"dequantized to bf16 ({len(self.dequantized)}, checkpoint-quantized, outside the scope): "
                         f"{shown}")
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in sorted(by_reason.items()):
            shown = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
            lines.append(f"kept in original precision ({len(names)}): {reason}: {shown}")
        return "\n".join(lines)


def _is_ours(obj) -> bool:
    return isinstance(obj, torch.nn.Linear) and is_fp8_linear(obj)


def original_linears(model) -> dict[str, torch.nn.Linear]:
    """The diffusion model's Linears as this patcher would run them without our FP8 patches.

    The live module tree may hold another clone's applied object patches; ComfyUI keeps the originals of
    applied patches in object_patches_backup (shared by all clones of one model), so look there first (swaps.py).
    """
    out = {}
    for name, live in model.model.diffusion_model.named_modules():
        key = f"diffusion_model.{name}"
        patched = swaps.get(model, key)
        if patched is not None and not _is_ours(patched):
            mod = patched  # someone else's object patch on this clone: quantize what this clone runs
        else:
            mod = swaps.original(model, key, live)
        if linear_like(mod) and not _is_ours(mod):
            out[name] = mod
    return out


def _plain_linear(mod, cast: bool = False) -> torch.nn.Linear:
    """An empty ComfyUI Linear (the class a bf16 checkpoint loads; with cast, the manual-cast one that casts its
    weight to the activation dtype per call) standing in for a MixedPrecisionOps Linear; its weight and bias are set
    from the dequantized tensors."""
    import comfy.ops

    cls = (comfy.ops.manual_cast if cast else comfy.ops.disable_weight_init).Linear
    lin = cls.__new__(cls)
    torch.nn.Module.__init__(lin)
    lin.in_features, lin.out_features = mod.in_features, mod.out_features
    lin.register_parameter("weight", None)
    lin.register_parameter("bias", None)
    return lin


def _as_selected(mod):
    """What layer selection sees of a Linear: a checkpoint-quantized one as the bf16 weight it is quantized from."""
    if not is_checkpoint_quantized(mod.weight):
        return mod
    return SimpleNamespace(weight=torch.empty(tuple(mod.weight.shape), dtype=torch.bfloat16, device="meta"))


def _stored_bytes(lin) -> int:
    w = lin.weight
    if not is_checkpoint_quantized(w):
        return linear_weight_bytes(lin)
    q = comfy_internals.checkpoint_qdata(w)
    if not isinstance(q, torch.Tensor):  # cannot read the stored data: its bf16 size is an upper bound (only the memory report uses it)
        return linear_weight_bytes(lin)
    return q.numel() * q.element_size()


def _dequantized_linear(model, lin, name, device, compute_dtype):
    """A bf16 ComfyUI Linear with the dequantized weight (and this clone's weight patches) of a checkpoint-quantized
    Linear outside the FP8 scope: compiled models then hold no tensor-subclass weights."""

    params, merged = _as_this_clone_runs(model, lin, name, device)
    # the model computes in its manual-cast dtype (e.g. float32 on a CPU): then cast the bf16 weight per call
    new = detached_copy(_plain_linear(lin, cast=compute_dtype is not None), device, None, params)
    return new, merged


LATE_PATCH_MESSAGE = (
    "{node}: this model's Linears are already FP8-quantized, so a LoRA (or another weight patch) cannot be applied "
    "after Quantize FP8 ({n} patched layers, e.g. {example}). Put LoraLoaderModelOnly (and other weight-patching "
    "nodes) before Quantize FP8 (FluxAccel): their changes are then merged into the FP8 weights.")


def _refuse_late_weight_patches(fp8_modules: list[str], node: str):
    """A PREPARE_SAMPLING wrapper (ComfyUI's sampler merges the patcher's wrappers and runs it before it loads the
    model): weight patches on FP8 Linears -- a LoRA added after Quantize FP8 -- are refused with what to do, before
    ComfyUI would try to patch FP8 data (0.33 casts a Float8Tensor weight first and fails with torchao's
    "unimplemented operator"). Outside the sampler an FP8 Linear refuses them itself (convert_weight)."""
    fp8_weights = {f"{k}.weight" for k in fp8_modules}

    def prepare_sampling(executor, model, *args, **kwargs):
        hit = sorted(k for k, v in model.patches.items() if v and k in fp8_weights)
        if hit:
            raise FluxAccelError(LATE_PATCH_MESSAGE.format(node=node, n=len(hit), example=hit[0]))
        return executor(model, *args, **kwargs)
    return prepare_sampling


@dataclass(frozen=True)
class Fp8State:
    """What Quantize FP8 applied to a clone: a ModelPatcher attachment (FP8_KEY), which ComfyUI's clones share.
    Never mutated: another config or remove_fp8 makes a new clone."""
    config: Fp8Config
    keys: tuple[str, ...]  # the object-patch keys of the quantized (and dequantized) Linears
    report: Fp8Report
    merged_patches: "_Kept"  # weight patches merged into the FP8 weights, restored by remove_fp8
    fused_keys: tuple[str, ...] = ()  # the object-patch keys of the activations fused into FP8 Linears (Identity)


def fp8_state(model) -> Fp8State | None:
    """The FP8 state Quantize FP8 put on this model, if any."""
    return model.get_attachment(FP8_KEY)


class _Kept(dict):
    """Weight patches merged into FP8 weights, kept for remove_fp8: (possibly large, never mutated) tensors, shared
    rather than copied should anything deep-copy the state."""

    def __deepcopy__(self, memo):
        return self


def _unpatched_live_tree(model, node: str) -> None:
    """Make the live module tree hold this model's stored weights and modules (ComfyUI's own unload, where another
    clone's patches are applied now), so that ComfyUI's weight patching reads the weights this clone patches."""
    if not (model.backup or model.object_patches_backup):
        return
    unloaded = comfy_internals.unload_model_and_clones(model)
    if isinstance(unloaded, Unavailable) or model.backup or model.object_patches_backup:
        raise FluxAccelError(f"{node}: another branch of this workflow has its patches applied to the loaded model "
                             f"({unloaded if isinstance(unloaded, Unavailable) else 'ComfyUI did not unload it'}), so "
                             f"this branch's LoRA cannot be merged from the stored weights. Free the model (the Unload "
                             f"Models button) and run again.")


def _as_this_clone_runs(model, lin: torch.nn.Linear, name: str, device: torch.device):
    """The weight and bias this clone runs for `lin`: where it has weight patches (LoRA, ...), ComfyUI's own
    patch_weight_to_device merges them as ComfyUI's loader would (its compute dtype, its rounding, the op's own
    convert/set functions; _unpatched_live_tree made the live tree the stored one); elsewhere the stored tensor; a
    checkpoint-quantized weight dequantized to bf16 (torchao per_row needs it). Returns ({param name: tensor},
    merged patch keys)."""
    merged, params = [], {}
    for p in ("weight", "bias"):
        t = getattr(lin, p, None)
        if t is None:
            continue
        key = f"diffusion_model.{name}.{p}"
        if model.patches.get(key):
            t = model.patch_weight_to_device(key, device_to=device, return_weight=True)
            merged.append(key)
        elif key in model.backup:  # another clone's patch is applied to the live weight: ComfyUI keeps the stored one
            t = model.backup[key].weight
        if is_checkpoint_quantized(t):  # scaled-FP8 / mixed-precision checkpoint: ComfyUI's own dequantization,
            t = t.dequantize().to(torch.bfloat16)  # in bf16 as a bf16 checkpoint's weights
        params[p] = t
    return params, merged


def _keep_merged(clone, merged_keys: list[str], merged: dict, report: Fp8Report) -> None:
    """Weight patches now inside the new weights: taken off the clone, kept aside for remove_fp8 (the baseline)."""
    for k in merged_keys:
        merged[k] = clone.patches.pop(k)
    report.merged_patches += merged_keys


def _quantize_one(model, clone, lin, name: str, cfg: Fp8Config, device, compute_dtype, report: Fp8Report,
                  merged: dict, home) -> str:
    """One chosen Linear as an FP8 object patch of the clone (its weight as this clone runs it: patches merged)."""
    params, merged_keys = _as_this_clone_runs(model, lin, name, device)
    if is_checkpoint_quantized(lin.weight):
        fmt = checkpoint_format(lin)
        report.requantized[fmt] = report.requantized.get(fmt, 0) + 1
    _keep_merged(clone, merged_keys, merged, report)
    # quantize on the GPU (fast); the copy waits for ComfyUI's load where _fp8_home says
    base = lin if isinstance(lin, torch.nn.Linear) else _plain_linear(lin)
    return _patch_in(clone, lin, name, quantize_linear(base, cfg, device, compute_dtype, params).to(home), report)


def _patch_in(clone, lin, name: str, q, report: Fp8Report) -> str:
    """The FP8 Linear q as the clone's object patch for lin, counted in the report."""
    key = f"diffusion_model.{name}"
    clone.add_object_patch(key, q)
    report.quantized.append(name)
    report.bytes_before += _stored_bytes(lin)
    report.bytes_after += linear_weight_bytes(q)
    return key


def _from_stored(model, clone, lin, name: str, parts: dict, like, device, compute_dtype, report: Fp8Report,
                 home) -> str:
    """One chosen Linear as an FP8 object patch built from the FP8 weights cache (no quantization)."""
    params, _ = _as_this_clone_runs(model, lin, name, device)  # the bias as this clone runs it (no patches here)
    q = plain_from_parts(lin, parts["weight"], parts["scale"], like, home, compute_dtype)
    if "bias" in params:
        q.bias = torch.nn.Parameter(params["bias"].detach().to(home, compute_dtype), requires_grad=False)
    return _patch_in(clone, lin, name, q, report)


def _fp8_home(model, device: torch.device, fp8_bytes: int, report: Fp8Report) -> torch.device:
    """Where the FP8 copies wait until ComfyUI loads the clone. On the load device when it has room for them beside
    ComfyUI's inference reserve: the host then holds no second copy (for FLUX.2 [dev], 32 GB), and ComfyUI's load
    moves nothing; until that load ComfyUI's memory checks count them as used memory of the device (not as a model
    it can unload), and its first unload moves them to the host like any loaded weights. Else where ComfyUI keeps
    unloaded weights (host RAM)."""
    import comfy.model_management as mm

    offload = torch.device(model.offload_device)
    if device.type == "cpu" or device == offload:
        return offload
    room = mm.get_free_memory(device) - mm.minimum_inference_memory()
    home = device if room > fp8_bytes else offload
    report.fp8_home = (f"on {device} until ComfyUI loads the model ({fp8_bytes / 1024**3:.1f} GiB, "
                       f"{room / 1024**3:.1f} GiB free beside ComfyUI's reserve)" if home == device else
                       f"in host RAM until ComfyUI loads the model ({device} has {room / 1024**3:.1f} GiB free beside "
                       f"ComfyUI's reserve, {fp8_bytes / 1024**3:.1f} GiB needed)")
    return home


def _same_fp8(q, parts: dict) -> bool:
    as_bytes = lambda t: t.detach().cpu().contiguous().view(torch.uint8)  # noqa: E731
    return (torch.equal(as_bytes(q.weight), as_bytes(parts["weight"]))
            and torch.equal(q.fp8_weight_scale.detach().cpu(), parts["scale"].detach().cpu()))


def _quantize_chosen(model, clone, originals: dict, chosen: list[str], cfg: Fp8Config, device, compute_dtype,
                     report: Fp8Report) -> tuple[list[str], "_Kept"]:
    """Every chosen Linear as an FP8 object patch: read from the FP8 weights cache where it holds this model (the
    first one is quantized all the same, and must match what the file holds), else quantized and saved there."""
    merged = _Kept()
    patched = [k for n in chosen for p in ("weight", "bias") if model.patches.get(k := f"diffusion_model.{n}.{p}")]
    entry = (fp8_weights.Entry(None, "the checkpoint is already quantized")
             if any(is_checkpoint_quantized(originals[n].weight) for n in chosen)
             else fp8_weights.entry_for(model, cfg, compute_dtype, patched))
    home = _fp8_home(model, device, sum(originals[n].weight.numel() for n in chosen), report)
    t0 = time.perf_counter()
    stored = fp8_weights.load(entry, {n: tuple(originals[n].weight.shape) for n in chosen}, home)
    keys = [_quantize_one(model, clone, originals[chosen[0]], chosen[0], cfg, device, compute_dtype, report, merged,
                          home)]
    like = clone.object_patches[keys[0]]
    if stored is not None and not _same_fp8(like, stored[chosen[0]]):
        log.warning("FluxAccel: the FP8 weights cache file %s holds other numbers than quantizing gives now; "
                    "quantizing instead (and saving again)", entry.path)
        stored = None
    for name in chosen[1:]:
        keys.append(_from_stored(model, clone, originals[name], name, stored[name], like, device, compute_dtype, report,
                                 home) if stored is not None else
                    _quantize_one(model, clone, originals[name], name, cfg, device, compute_dtype, report, merged, home))
    if stored is not None:
        report.weights_cache = (f"loaded {len(chosen) - 1} Linears from {entry.path} to {home} in "
                                f"{time.perf_counter() - t0:.2f} s (the first quantized and checked)")
    elif entry.key is not None:
        fp8_weights.save(entry, {n: {"weight": clone.object_patches[k].weight,
                                       "scale": clone.object_patches[k].fp8_weight_scale} for n, k in zip(chosen, keys)})
        report.weights_cache = f"saving to {entry.path}"
    else:
        report.weights_cache = f"not cached: {entry.why_not}"
    return keys, merged


def _dequantize_one(model, clone, lin, name: str, device, compute_dtype, report: Fp8Report, merged: dict) -> str:
    """A checkpoint-quantized Linear outside the scope, as a plain bf16 Linear (the compiled graph runs it)."""
    new, merged_keys = _dequantized_linear(model, lin, name, device, compute_dtype)
    _keep_merged(clone, merged_keys, merged, report)
    key = f"diffusion_model.{name}"
    clone.add_object_patch(key, new.to(model.offload_device))
    report.dequantized.append(name)
    report.bytes_before += _stored_bytes(lin)
    report.bytes_after += linear_weight_bytes(new)
    return key


def _fuse_activations(model, clone, dm, cfg: Fp8Config, report: Fp8Report) -> list[str]:
    """The MLP activations (GELU, FLUX.2's SiLU gate) whose output an FP8 Linear of this clone takes, moved into that
    Linear (an Identity patched in their place): their object-patch keys. The report says how many, and why any was
    kept."""
    sites, kept = act_fusion.find_sites(dm, lambda name, m: swaps.original(model, f"diffusion_model.{name}", m))
    keys = []
    for act in ("gelu", "silu_gate"):
        mine = [site for site in sites if site.act == act]
        kept_here = {name: why for name, (kind, why) in kept.items() if kind == act}
        line, fused = _fuse_sites(clone, mine, kept_here, cfg, act)
        keys += fused
        if act == "gelu":
            report.gelu = line
        elif mine or kept_here:  # FLUX.2's line; FLUX.1's report stays as it was
            report.silu_gate = line
    return keys


def _fuse_sites(clone, sites, kept: dict[str, str], cfg: Fp8Config, act: str) -> tuple[str, list[str]]:
    """(the report's line, the object-patch keys) for fusing the sites of one activation kind."""
    name = act_fusion.NAMES[act]
    why = cfg.fusion_unavailable(act) if sites else ""
    if why:
        return f"MLP {name} kept separate: {why}", []
    keys = []
    for site in sites:
        q = swaps.get(clone, f"diffusion_model.{site.linear}")
        if q is None or not is_fp8_linear(q) or q.fp8_act_kwargs.float8_dtype != torch.float8_e4m3fn:
            kept[site.module] = "the Linear after it is not quantized to float8_e4m3fn"
            continue
        q.fused_act, q.act_from = act, site.act_from
        keys.append(f"diffusion_model.{site.module}")
        clone.add_object_patch(keys[-1], torch.nn.Identity())
    what = "GELU(tanh)" if act == "gelu" else "SiLU-gated"
    line = (f"MLP {name} fused into the FP8 quantization of the next Linear (one pass) at {len(keys)} of "
            f"{len(keys) + len(kept)} {name}s" if keys or kept else f"no {what} MLP in this model to fuse")
    if kept:
        line += f"; kept separate ({len(kept)}): {'; '.join(sorted(set(kept.values())))}"
    return line, keys


def apply_fp8(model, cfg: Fp8Config, node: str = NODE):
    """Return (clone with FP8 Linears, report). The input model is left untouched.

    Quantizing a model that already carries the same FP8 config is a no-op (the same model is returned);
    a different config re-quantizes from the original bf16 weights, never from FP8.
    """
    require_flux(model, node)
    require_torch(node)
    require_torchao()
    model = resident(model, node)  # ComfyUI 0.33+ dynamic VRAM: a resident copy sharing its weights (models/resident.py)
    dm = require_flux(model, node)
    require_fully_loaded(model, node)
    prev = fp8_state(model)
    if prev is not None and prev.config.key() == cfg.key():
        report = dataclasses.replace(prev.report, already_applied=True)
        log.info("%s", report.summary())
        return model, report
    if prev is not None:  # another FP8 config: start again from the model as it was before quantization
        model = remove_fp8(model)
    device = torch.device(model.load_device)
    require_fp8_device(device)
    require_compatible(model, dm, node, quantized_ok=True)

    originals = original_linears(model)
    require_bf16_weights([m for m in originals.values() if not is_checkpoint_quantized(m.weight)], node)
    compute_dtype = getattr(model.model, "manual_cast_dtype", None)
    sel = select_linears(((n, _as_selected(m)) for n, m in originals.items()), cfg, profile(model))
    if any(model.patches.get(f"diffusion_model.{n}.{p}") for n in originals for p in ("weight", "bias")):
        _unpatched_live_tree(model, node)  # ComfyUI's weight patching reads the live tree

    clone = model.clone()
    report = Fp8Report(cfg.granularity, cfg.scope, str(device), skipped=dict(sel.skipped))
    keys, merged = _quantize_chosen(model, clone, originals, sel.chosen, cfg, device, compute_dtype, report)
    for name in sel.skipped:
        if is_checkpoint_quantized(originals[name].weight):
            keys.append(_dequantize_one(model, clone, originals[name], name, device, compute_dtype, report, merged))
    if not report.quantized:
        raise FluxAccelError(f"{node}: no Linear layer matched scope '{cfg.scope}'; choose scope all_linear.")
    fused_keys = _fuse_activations(model, clone, dm, cfg, report)
    swaps.regroup(clone, (*keys, *fused_keys))  # one object patch per block: ComfyUI re-applies each at every prompt
    # A fresh patches_uuid makes ComfyUI unpatch/move the model when it switches between this clone and
    # another one, so the GPU holds only the weights of the clone being run.
    clone.patches_uuid = uuid.uuid4()
    clone.size = max(1, model.model_size() - report.bytes_saved)
    # FP8 weights cannot be streamed per layer by ComfyUI's lowvram path
    clone.add_callback_with_key(on_load_callback_type(), FP8_KEY, partial_load_guard(node))
    fp8_keys = [f"diffusion_model.{n}" for n in report.quantized]  # the dequantized bf16 ones can take patches
    clone.add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, FP8_KEY, _refuse_late_weight_patches(fp8_keys, node))
    clone.set_attachments(FP8_KEY, Fp8State(cfg, tuple(keys), report, merged, tuple(fused_keys)))
    log.info("%s", report.summary())
    return clone, report


def remove_fp8(model):
    """A clone of `model` running its original Linears again (the default Benchmark baseline)."""
    prev = fp8_state(model)
    if prev is None:
        return model
    clone = model.clone()
    swaps.remove(clone, (*prev.keys, *prev.fused_keys))
    for key, patches in prev.merged_patches.items():
        clone.patches[key] = list(patches)
    clone.remove_callbacks_with_key(on_load_callback_type(), FP8_KEY)
    clone.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, FP8_KEY)
    clone.remove_attachments(FP8_KEY)
    clone.patches_uuid = uuid.uuid4()
    clone.size = model.model_size() + prev.report.bytes_saved
    return clone
