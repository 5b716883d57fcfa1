"""Tensor-level FP8: the config, which Linears of FLUX to quantize, and quantizing one Linear.

The quantized Linear as ComfyUI runs it is in linear.py, the patching of a ComfyUI model in patch.py; this file
knows nothing of ComfyUI.
Quantization itself is torchao's: quantize_ with Float8DynamicActivationFloat8WeightConfig
(dynamic FP8 activations, FP8 weights, e4m3), per-tensor or per-row scales. Its Float8Tensor is kept as its FP8
data and scale, plain tensors, and run through torchao's own activation quantization and scaled GEMM functions
(fp8_linear), so a compiled model takes no tensor-subclass inputs (no per-call flatten/unflatten or subclass guards).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch

from ..env import require_torchao
from ..errors import FluxAccelError
from ..inputs import node_field, node_inputs
from ..models.loaded import is_checkpoint_quantized
from ..models.profiles import FLUX1, Profile
from ..upstream import say, torchao_internals
from ..upstream.torchao_internals import float8_primitives
from . import act_quant
from .act_quant import SILU_UNAVAILABLE as SILU_GATE_OP_UNAVAILABLE, UNAVAILABLE as GELU_OP_UNAVAILABLE

Granularity = Literal["per_tensor", "per_row"]
Scope = Literal["blocks", "blocks+modulation", "all_linear"]
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_row")
SCOPES: tuple[str, ...] = ("blocks", "blocks+modulation", "all_linear")
# inputs the Quantize FP8 node had once, which saved workflows may still set: FluxAccel decides them now
REMOVED_INPUTS: tuple[str, ...] = ("layout", "fuse_gelu", "fuse_silu_gate")


@dataclass(frozen=True)
class Fp8Config:
    """Which Linears of a FLUX diffusion model to quantize, and with which scale granularity.

    scope (where a FLUX architecture keeps its modulation Linears: models/profiles.py):
      blocks             the Linears inside double/single blocks, except modulation (default: the GEMMs
                         that carry ~all FLOPs; embedders, modulation and the final layer stay bf16)
      blocks+modulation  also the modulation Linears (small M: FLUX.1's per-block img_mod/txt_mod/modulation,
                         FLUX.2's three shared modulations, Chroma's distilled guidance network)
      all_linear         every Linear, embedders and final layer included

    The weights are held as plain tensors (FP8 data and scales) and run through torchao's own functions (fp8_linear):
    a compiled model takes no tensor-subclass inputs. Where an MLP activation feeds an FP8 Linear (FLUX.1's GELU,
    FLUX.2's SiLU gate) and the scales are per row, the activation and the quantization run in one pass
    (act_fusion.py); fusion_unavailable says why not elsewhere.
    """

    granularity: Granularity = dataclasses.field(default="per_row", metadata=node_field())
    scope: Scope = dataclasses.field(default="blocks", metadata=node_field())

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise FluxAccelError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.scope not in SCOPES:
            raise FluxAccelError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    @classmethod
    def from_inputs(cls, inputs: dict, node: str) -> "Fp8Config":
        return cls(**node_inputs(cls, inputs, REMOVED_INPUTS, node))

    def key(self) -> list[str]:
        """What identifies this config in a model's options (and in compile-cache keys)."""
        return self.weights_key() + [f"{act.replace('_', '-')}-fused" for act in self.fused_activations()]

    def fused_activations(self) -> tuple[str, ...]:
        """The activations ("gelu", "silu_gate") fused into the FP8 quantization under this config, here."""
        return tuple(act for act in ("gelu", "silu_gate") if not self.fusion_unavailable(act))

    def weights_key(self) -> list[str]:
        """What decides the FP8 weights themselves (the FP8 weights cache's key)."""
        return [self.granularity, self.scope, "plain"]

    def fusion_unavailable(self, act: str) -> str:
        """Why the activation `act` ("gelu", "silu_gate") cannot be fused into the FP8 quantization here ('' where it
        can)."""
        if self.granularity != "per_row":
            return "per_tensor activation scales need the whole tensor's absmax before any row is quantized"
        return GELU_OP_UNAVAILABLE if act == "gelu" else SILU_GATE_OP_UNAVAILABLE

    def torchao_config(self):
        """The torchao config; set_inductor_config=False keeps process-wide inductor settings untouched, and the
        kernel preference is pinned to torchao's TORCH path (torch._scaled_mm), the one fp8_linear replays."""
        require_torchao()
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

        gran = PerRow() if self.granularity == "per_row" else PerTensor()
        torch_path = torchao_internals.torch_kernel_preference()
        pin = {"kernel_preference": torch_path} if torch_path else {}
        if not torch_path:  # an older torchao has only the TORCH path; a newer one may pick another kernel library
            say(torch_path, "torchao picks its FP8 GEMM kernel itself: FluxAccel's FP8 Linear may round differently "
                            "from torchao's own", level=logging.INFO)
        return Float8DynamicActivationFloat8WeightConfig(granularity=gran, set_inductor_config=False, **pin)


def in_scope(name: str, scope: str, profile: Profile = FLUX1) -> bool:
    """Name filter over diffusion-model-relative Linear names (e.g. 'double_blocks.0.img_attn.qkv'); where the
    modulation Linears are depends on the architecture (models/profiles.py)."""
    return profile.in_scope(name, scope)


@dataclass
class Selection:
    chosen: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason


def select_linears(named_linears: Iterable[tuple[str, torch.nn.Linear]], cfg: Fp8Config,
                   profile: Profile = FLUX1) -> Selection:
    """Split the Linears into those to quantize and those kept, with the reason for each kept one."""
    sel = Selection()
    for name, lin in named_linears:
        w = lin.weight
        if not in_scope(name, cfg.scope, profile):
            sel.skipped[name] = f"outside scope '{cfg.scope}'"
        elif w.shape[0] % 16 or w.shape[1] % 16:
            sel.skipped[name] = f"shape {tuple(w.shape)} not divisible by 16 (FP8 GEMM needs it)"
        elif cfg.granularity == "per_row" and not is_checkpoint_quantized(w) and w.dtype != torch.bfloat16:
            raise FluxAccelError(  # a checkpoint-quantized weight is re-quantized from its bf16 dequantization
                f"per_row FP8 needs bfloat16 weights, but {name} is {w.dtype}. Load the model in bf16 "
                f"(UNETLoader weight_dtype 'default' on a bf16 GPU, or ComfyUI's --bf16-unet) or choose "
                f"granularity per_tensor."
            )
        else:
            sel.chosen.append(name)
    return sel


def is_fp8_weight(t: torch.Tensor) -> bool:
    """A torchao Float8Tensor (what torchao's quantize_ makes of a weight, before quantize_linear keeps its parts)."""
    return hasattr(t, "qdata") and hasattr(t, "scale")


def linear_weight_bytes(m: torch.nn.Linear) -> int:
    """Bytes the weight of a Linear occupies: FP8 data plus scales once quantized, plain size otherwise."""
    w = m.weight
    scale = getattr(m, "fp8_weight_scale", None)
    extra = scale.numel() * scale.element_size() if scale is not None else 0
    return w.numel() * w.element_size() + extra


_AO = None  # torchao's float8 primitives (upstream/torchao_internals.py), found when an FP8 Linear is made


def float8_ops():
    """torchao's float8 primitives, found once (outside any trace: fp8_linear reads the module global)."""
    global _AO
    if _AO is None:
        found = float8_primitives()
        if not found:
            raise FluxAccelError(f"Quantize FP8 calls torchao's float8 functions, but {found}. Install torchao 0.17 "
                                 f"or 0.18: python -m pip install 'torchao>=0.17,<0.19'")
        _AO = found
    return _AO


def fp8_linear(x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """torchao's Float8Tensor linear on plain tensors: the functions its torch-kernel path calls, in its order.

    x: activations (..., K) in the compute dtype; lin: an FP8 Linear (linear.py) -- weight: FP8 data (N, K);
    fp8_weight_scale: its scales, (N, 1) per-row or (1, 1) per-tensor; fp8_act_kwargs: the weight's
    QuantizeTensorToFloat8Kwargs (how torchao quantizes activations); fp8_mm_config: its Float8MMConfig.
    Bit-identical to F.linear(x, Float8Tensor weight) in eager mode (tests/core/quant/test_fp8.py); torchao's
    optional MSLK kernels (not installed here) are not used.
    """
    ao, act_kwargs = _AO or float8_ops(), lin.fp8_act_kwargs
    block = list(ao.get_block_size(x.shape, act_kwargs.granularity))
    x_scale = ao.choose_scale(x, float8_dtype=act_kwargs.float8_dtype, block_size=block,
                              hp_value_lb=act_kwargs.hp_value_lb, hp_value_ub=act_kwargs.hp_value_ub)
    x_data = ao.quantize(x, x_scale, act_kwargs.float8_dtype)
    return _scaled_gemm(ao, x_data.reshape(-1, x_data.shape[-1]), ao.preprocess_scale(x_scale, x.shape), lin, x)


def _scaled_gemm(ao, x_data, x_scale, lin, x):
    """torchao's scaled GEMM of quantized rows x_data (M, K) with their scales (M, 1) or (1, 1) by lin's FP8 weight,
    shaped as x."""
    w_data, mm_config = lin.weight, lin.fp8_mm_config
    a, b = ao.preprocess_data(x_data, w_data.t(), mm_config)
    out = ao.addmm(a, x_scale, b, lin.fp8_weight_scale.t(), output_dtype=x.dtype, bias=lin.bias,
                   use_fast_accum=mm_config.use_fast_accum)
    return out.reshape(*x.shape[:-1], w_data.shape[0])


# the fused activations (act_fusion.py): one-pass quantization of one input, and of a row read from two
_FUSED_QUANT = {"gelu": (act_quant.gelu_rowwise_fp8, act_quant.gelu_pair_rowwise_fp8),
                "silu_gate": (act_quant.silu_gate_rowwise_fp8, act_quant.silu_gate_pair_rowwise_fp8)}


def fp8_linear_act(x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """fp8_linear of x with lin's fused activation (GELU(tanh), or FLUX.2's SiLU gate: lin.fused_act) applied to its
    columns from lin.act_from on, the activation and the row-wise activation quantization done in one pass
    (act_quant.py); per-row activation scales only."""
    ao, act_kwargs = _AO or float8_ops(), lin.fp8_act_kwargs
    x_data, x_scale = _FUSED_QUANT[lin.fused_act][0](x, lin.act_from, act_kwargs.hp_value_lb, act_kwargs.hp_value_ub)
    return _scaled_gemm(ao, x_data, x_scale, lin, x)


def fp8_linear_act_pair(a: torch.Tensor, m: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """fp8_linear_act of torch.cat((a, m), -1) with the activation from a's end on, the row read from a and m where
    they are (the concatenation is never written); per-row activation scales only."""
    ao, act_kwargs = _AO or float8_ops(), lin.fp8_act_kwargs
    x_data, x_scale = _FUSED_QUANT[lin.fused_act][1](a, m, act_kwargs.hp_value_lb, act_kwargs.hp_value_ub)
    return _scaled_gemm(ao, x_data, x_scale, lin, a)
