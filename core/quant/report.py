"""What Quantize FP8 did, in words: the node's text and the log."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.loaded import checkpoint_format, is_checkpoint_quantized
from ..upstream import comfy_internals
from .fp8 import linear_weight_bytes
from .linear import is_fp8_linear


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

    def count(self, name: str, original: torch.nn.Module, new: torch.nn.Module) -> None:
        """One Linear made: FP8 (quantized, or re-quantized from a checkpoint's format) or dequantized to bf16."""
        if is_fp8_linear(new):
            self.quantized.append(name)
            if is_checkpoint_quantized(original.weight):
                fmt = checkpoint_format(original)
                self.requantized[fmt] = self.requantized.get(fmt, 0) + 1
        else:
            self.dequantized.append(name)
        self.bytes_before += _stored_bytes(original)
        self.bytes_after += linear_weight_bytes(new)

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


def _stored_bytes(lin) -> int:
    w = lin.weight
    if not is_checkpoint_quantized(w):
        return linear_weight_bytes(lin)
    q = comfy_internals.checkpoint_qdata(w)
    if not isinstance(q, torch.Tensor):  # cannot read the stored data: its bf16 size bounds it (the report only)
        return linear_weight_bytes(lin)
    return q.numel() * q.element_size()
