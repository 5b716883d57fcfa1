"""Which Linears Quantize FP8 works from: the model's Linears as this clone runs them (without FluxAccel's own FP8
patches), split by the config into those to quantize, those kept and, of a checkpoint ComfyUI quantized itself, those
to dequantize; the live module tree made the stored one where ComfyUI's weight patching must read it."""
from __future__ import annotations

from dataclasses import dataclass, field
import torch

from ..errors import FluxAccelError
from ..models import swaps
from ..models.flux import FluxModel, require_bf16_weights
from ..models.loaded import is_checkpoint_quantized, linear_like, stored_live_tree
from .fp8 import Fp8Config, select_linears
from .linear import is_fp8_linear


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

    def as_run(self, merged: dict):
        """(name, Linear, {weight, bias}) for each chosen Linear, then each to dequantize, one at a time (at most one
        merged weight exists at once): the tensors this clone runs. Where it has weight patches (LoRA, ...),
        ComfyUI's own patch_weight_to_device merges them as ComfyUI's loader would (its compute dtype, its rounding,
        the op's own convert/set functions; read() made the live tree the stored one), and `merged` gets each
        patch key with its patches; elsewhere the stored tensor; a checkpoint-quantized weight dequantized to bf16
        (torchao per_row needs it)."""
        model = self.model
        for name in (*self.chosen, *self.dequantize):
            lin, params = self.originals[name], {}
            for p in ("weight", "bias"):
                t = getattr(lin, p, None)
                key = f"diffusion_model.{name}.{p}"
                if t is not None and model.patches.get(key):
                    t = model.patch_weight_to_device(key, device_to=self.device, return_weight=True)
                    merged[key] = model.patches[key]
                elif t is not None and key in model.backup:  # another clone's patch is on the live weight
                    t = model.backup[key].weight
                if t is not None and is_checkpoint_quantized(t):  # ComfyUI's own dequantization, in bf16 as a
                    t = t.dequantize().to(torch.bfloat16)  # bf16 checkpoint's weights
                if t is not None:
                    params[p] = t
            yield name, lin, params


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
    patches = lambda names: [k for n in names for p in ("weight", "bias")  # noqa: E731
                             if model.patches.get(k := f"diffusion_model.{n}.{p}")]
    if patches(originals):  # ComfyUI's weight patching reads the live tree: it must hold this model's stored weights
        stored_live_tree(model, flux.node)
    return Linears(model, originals, sel.chosen, dict(sel.skipped),
                   [n for n in sel.skipped if is_checkpoint_quantized(originals[n].weight)], patches(sel.chosen))


def _is_ours(obj) -> bool:
    return isinstance(obj, torch.nn.Linear) and is_fp8_linear(obj)
