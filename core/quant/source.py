"""Which Linears Quantize FP8 works from: the model's Linears as this clone runs them (without FluxAccel's own FP8
patches), split by the config into those to quantize, those kept and, of a checkpoint ComfyUI quantized itself, those
to dequantize; the live module tree made the stored one where ComfyUI's weight patching must read it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
import torch

from ..errors import FluxAccelError
from ..models import swaps
from ..models.flux import FluxModel, require_bf16_weights
from ..models.loaded import is_checkpoint_quantized, linear_like
from ..upstream import Unavailable, comfy_internals
from .fp8 import Fp8Config, select_linears
from .linear import is_fp8_linear

log = logging.getLogger("fluxaccel.fp8")


@dataclass
class Linears:
    """The Linears of one Quantize FP8 run: `originals` by diffusion-model name as this clone runs them; `chosen` to
    quantize; `skipped` kept, with the reason; `dequantize`, checkpoint-quantized ones outside the scope (made bf16);
    `weight_patches`, the weight-patch keys (LoRA, ...) this clone has on the chosen ones."""

    model: object  # the resident ModelPatcher
    originals: dict[str, torch.nn.Module]
    chosen: list[str]
    skipped: dict[str, str]
    dequantize: list[str] = field(default_factory=list)
    weight_patches: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.load_device)

    @property
    def compute_dtype(self):
        """ComfyUI's manual-cast compute dtype (bf16 weights computed in float32 on a CPU), or None."""
        return getattr(self.model.model, "manual_cast_dtype", None)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each chosen Linear's weight shape."""
        return {n: tuple(self.originals[n].weight.shape) for n in self.chosen}

    @property
    def uncached(self) -> str:
        """Why the FP8 weights cache cannot hold this run's weights ('' where it can)."""
        if self.weight_patches:
            return f"{len(self.weight_patches)} weight patches (LoRA, ...) are merged into these weights"
        if any(is_checkpoint_quantized(self.originals[n].weight) for n in self.chosen):
            return "the checkpoint is already quantized"
        return ""

    def as_run(self, merged: dict, sources: dict | None = None):
        """(name, Linear, {weight, bias}) for each chosen Linear, then each to dequantize, one at a time (at most one
        merged weight exists at once). Each is its stored tensor (ComfyUI's backup where another clone's patch is
        applied to the live one now; a checkpoint-quantized weight dequantized to bf16, as torchao per_row needs
        it), a chosen one's with this clone's weight patches (LoRA, ...) merged by ComfyUI's own weight patching
        (upstream/comfy_internals.patched_weight): `merged` gets each merged key with its patches. A Linear made
        bf16 keeps its patches for ComfyUI's load. `sources`: where a patched one's stored weight is kept on the device
        (kept())."""
        model = self.model
        for name in (*self.chosen, *self.dequantize):
            lin, params = self.originals[name], {}
            for p in ("weight", "bias"):
                key = f"diffusion_model.{name}.{p}"
                t = model.backup[key].weight if key in model.backup else getattr(lin, p, None)
                if t is None:
                    continue
                if is_checkpoint_quantized(t):  # ComfyUI's own dequantization, in bf16 as a bf16 checkpoint's
                    t = t.dequantize().to(torch.bfloat16)
                if model.patches.get(key) and name in self.chosen:  # (a bf16 one is patched by ComfyUI's load)
                    if sources is not None:
                        t = kept(sources, key, t, self.device)
                    t = patched(model.patches[key], key, t, self.device)
                    merged[key] = model.patches[key]
                params[p] = t
            yield name, lin, params


def patched(patches: list, key: str, stored: torch.Tensor, device) -> torch.Tensor:
    """The stored tensor at `key` with these weight patches merged by ComfyUI's own weight patching; refused, with
    what to do, where this ComfyUI's patching is not where FluxAccel reads it."""
    t = comfy_internals.patched_weight(patches, key, stored, device)
    if isinstance(t, Unavailable):
        raise FluxAccelError(f"Quantize FP8 (FluxAccel): this ComfyUI's weight patching is not where FluxAccel reads "
                             f"it ({t}); LoRAs cannot be merged into FP8 weights here. Run without Quantize FP8, or "
                             f"report this.")
    return t


def kept(sources: dict, key: str, stored: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The stored weight at `key` on `device`, kept in `sources` for the next merge of its Linear (a LoRA change then
    reads no host memory), while the device keeps a quarter of its memory (at least twice ComfyUI's inference
    reserve) free beside it for the sampler; else `stored` as it is (said once per set of sources)."""
    if key in sources:
        return sources[key]
    if device.type == "cpu" or stored.device == device or sources.get(_REFUSED):
        return stored
    from comfy import model_management as mm

    room = mm.get_free_memory(device) - max(2 * mm.minimum_inference_memory(), mm.get_total_memory(device) // 4)
    if room < stored.numel() * stored.element_size():
        sources[_REFUSED] = True
        log.info("FluxAccel: %s keeps the bf16 weights of %d patched FP8 Linears for LoRA changes; the others are "
                 "read from host memory at each change (%.1f GiB free beside the sampler's share)", device,
                 len(sources), max(room, 0) / 1024**3)
        return stored
    sources[key] = stored.to(device, copy=True)
    return sources[key]


_REFUSED = "(no room on the device)"


def read(flux: FluxModel, cfg: Fp8Config) -> Linears:
    """The Linears of `flux`'s model for `cfg`, checked (bf16 weights, something in scope)."""
    model = flux.model
    originals = {}
    for name, live in model.model.diffusion_model.named_modules():
        key = f"diffusion_model.{name}"
        patched = swaps.get(model, key)
        # someone else's object patch on this clone: quantize what this clone runs; else the stored module (the live
        # tree may hold another clone's applied patches: swaps.original)
        mod = patched if patched is not None and not _is_ours(patched) else swaps.original(model, key, live)
        if linear_like(mod) and not _is_ours(mod):
            originals[name] = mod
    require_bf16_weights([m for m in originals.values() if not is_checkpoint_quantized(m.weight)], flux.node)
    sel = select_linears(originals.items(), cfg, flux.profile)
    if not sel.chosen:
        raise FluxAccelError(f"{flux.node}: no Linear layer matched scope '{cfg.scope}'; choose scope all_linear.")
    patched = [k for n in sel.chosen for p in ("weight", "bias") if model.patches.get(k := f"diffusion_model.{n}.{p}")]
    return Linears(model, originals, sel.chosen, dict(sel.skipped),
                   [n for n in sel.skipped if is_checkpoint_quantized(originals[n].weight)], patched)


def _is_ours(obj) -> bool:
    return isinstance(obj, torch.nn.Linear) and is_fp8_linear(obj)
