"""FLUX's MLP activation and its row-wise FP8 quantization in one pass over memory.

The second Linear of a FLUX MLP takes GELU(tanh) of the first one's output (the single block: its attention output
concatenated before it). With dynamic row-wise FP8 (fp8.py), inductor fuses GELU, the row's absmax and the cast into
one reduction kernel that reads each row twice and evaluates GELU twice. `gelu_rowwise_fp8` does it in one pass:
one program per row holds the whole row in registers, evaluates GELU once, reduces, scales and casts.

Numerics are torchao's dynamic row-wise activation quantization of the bf16 GELU output (fp8.fp8_linear): GELU
rounded to the input's dtype as eager rounds it, scale = the row's absmax / 448 in that dtype (with torchao's
lower/upper bounds on the absmax where set), values divided by the scale, clamped to +-448 and rounded to e4m3. The
GPU kernel (Triton, as a `torch.library.triton_op`, so inductor compiles it into the graph) computes GELU through
exp2 and an approximate division and multiplies by the scale's reciprocal, as inductor's own kernels do: a GELU value
or an FP8 value differs from torch's in its last bit now and then.
Off the GPU the op runs the same in torch.

`gelu_pair_rowwise_fp8` quantizes the same row read from two tensors, [a | GELU(m)]: the single block's attention
output and MLP stream, so that FluxAccel's single-block forward (compile/single_block.py) never writes their
concatenation. Its numbers are the one-input op's on the concatenated row.

FLUX.2's MLPs gate instead: SiLU(m1) * m2 of the first Linear's output [m1 | m2] (ComfyUI's SiLUActivation).
`silu_gate_rowwise_fp8` and `silu_gate_pair_rowwise_fp8` are the same two ops for that activation: they read the
first Linear's whole output and write the quantized gated row, which is never written in bf16.
"""
from __future__ import annotations

import importlib.util

import torch
from torch.library import triton_op, wrap_triton

FP8_MAX = 448.0  # float8_e4m3fn's largest value
MAX_ROW = 32768  # the widest row one program holds in registers (FLUX.1's MLPs: 12,288 and 15,360)
OP_NAME = "fluxaccel::gelu_rowwise_fp8"
PAIR_OP_NAME = "fluxaccel::gelu_pair_rowwise_fp8"
SILU_OP_NAME = "fluxaccel::silu_gate_rowwise_fp8"
SILU_PAIR_OP_NAME = "fluxaccel::silu_gate_pair_rowwise_fp8"


def gelu_columns(x: torch.Tensor, gelu_from: int) -> torch.Tensor:
    """x with GELU(tanh) applied to its last dimension's columns from `gelu_from` on (in x's dtype, as eager)."""
    gelu = torch.nn.functional.gelu(x[..., gelu_from:], approximate="tanh")
    return torch.cat([x[..., :gelu_from], gelu], -1) if gelu_from else gelu


def silu_gate_columns(x: torch.Tensor, gate_from: int) -> torch.Tensor:
    """x = [x0 | m1 | m2] (x0: `gate_from` columns) as [x0 | SiLU(m1) * m2], in x's dtype as ComfyUI's SiLUActivation
    computes it."""
    m1, m2 = x[..., gate_from:].chunk(2, dim=-1)
    gated = torch.nn.functional.silu(m1) * m2
    return torch.cat([x[..., :gate_from], gated], -1) if gate_from else gated


def activation_columns(x: torch.Tensor, act: str, act_from: int) -> torch.Tensor:
    """x with the fused activation `act` ("gelu" or "silu_gate") applied from column `act_from` on."""
    return gelu_columns(x, act_from) if act == "gelu" else silu_gate_columns(x, act_from)


def reference(x: torch.Tensor, gelu_from: int, lb: float | None = None, ub: float | None = None):
    """(q, scale) of x (M, N): GELU(tanh) on the columns from `gelu_from` on, then torchao's row-wise FP8."""
    return rowwise(gelu_columns(x, gelu_from), lb, ub)


def silu_gate_reference(x: torch.Tensor, gate_from: int, lb: float | None = None, ub: float | None = None):
    """(q, scale) of x (M, gate_from + 2 H): [x0 | SiLU(m1) * m2] (silu_gate_columns), then torchao's row-wise FP8."""
    return rowwise(silu_gate_columns(x, gate_from), lb, ub)


def rowwise(h: torch.Tensor, lb: float | None = None, ub: float | None = None):
    """(q, scale) of h (M, N): torchao's dynamic row-wise FP8 e4m3 quantization (scales float32, (M, 1))."""
    amax = h.abs().amax(-1, keepdim=True)
    if lb is not None or ub is not None:
        amax = amax.clamp(min=lb, max=ub)
    scale = (amax / FP8_MAX).float()  # divided in the activation's dtype, as torchao divides
    q = (h.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _kernel(name: str = "gelu_rowwise_fp8_kernel"):
    """A Triton kernel of act_quant_kernel.py (which imports triton: imported here, at a GPU call, not with
    FluxAccel)."""
    from . import act_quant_kernel

    return getattr(act_quant_kernel, name)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (Triton's rule for a block that holds a row)."""
    return 1 << max(0, n - 1).bit_length()


WARPS_PER_ELEMENTS = 1024  # one warp per this many elements of a row (4 to 32 warps): see num_warps


def num_warps(block: int) -> int:
    """Warps per row program: enough threads that a row's elements fit in registers."""
    return min(32, max(4, block // WARPS_PER_ELEMENTS))


def _gpu(x, gelu_from, lb, ub):

    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = next_power_of_2(n)
    wrap_triton(_kernel())[(m,)](x, q, s, n, x.stride(0), q.stride(0), 0.0 if lb is None else lb,
                                 0.0 if ub is None else ub, GELU_FROM=gelu_from, HAS_LB=lb is not None,
                                 HAS_UB=ub is not None, BLOCK=block, num_warps=num_warps(block))
    return q, s


def _gpu_pair(a, m, lb, ub):

    rows, n_a = a.shape
    n_m = m.shape[1]
    q = torch.empty((rows, n_a + n_m), device=a.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=a.device, dtype=torch.float32)
    block_a, block_m = next_power_of_2(n_a), next_power_of_2(n_m)
    wrap_triton(_kernel("gelu_pair_rowwise_fp8_kernel"))[(rows,)](
        a, m, q, s, n_a, n_m, a.stride(0), m.stride(0), q.stride(0), 0.0 if lb is None else lb,
        0.0 if ub is None else ub, HAS_LB=lb is not None, HAS_UB=ub is not None, BLOCK_A=block_a, BLOCK_M=block_m,
        num_warps=num_warps(max(block_a, block_m)))
    return q, s


def _gpu_silu(x, gate_from, lb, ub):

    m, n_in = x.shape
    half = (n_in - gate_from) // 2
    n = gate_from + half
    q = torch.empty((m, n), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = next_power_of_2(n)
    wrap_triton(_kernel("silu_gate_rowwise_fp8_kernel"))[(m,)](
        x, q, s, n, half, x.stride(0), q.stride(0), 0.0 if lb is None else lb, 0.0 if ub is None else ub,
        GATE_FROM=gate_from, HAS_LB=lb is not None, HAS_UB=ub is not None, BLOCK=block, num_warps=num_warps(block))
    return q, s


def _gpu_silu_pair(a, m, lb, ub):

    rows, n_a = a.shape
    half = m.shape[1] // 2
    q = torch.empty((rows, n_a + half), device=a.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=a.device, dtype=torch.float32)
    block_a, block_h = next_power_of_2(n_a), next_power_of_2(half)
    wrap_triton(_kernel("silu_gate_pair_rowwise_fp8_kernel"))[(rows,)](
        a, m, q, s, n_a, half, a.stride(0), m.stride(0), q.stride(0), 0.0 if lb is None else lb,
        0.0 if ub is None else ub, HAS_LB=lb is not None, HAS_UB=ub is not None, BLOCK_A=block_a, BLOCK_H=block_h,
        num_warps=num_warps(max(block_a, block_h)))
    return q, s


def _op_body(x: torch.Tensor, gelu_from: int, lb: float | None, ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cuda":
        return _gpu(x, gelu_from, lb, ub)
    return reference(x, gelu_from, lb, ub)


def _pair_body(a: torch.Tensor, m: torch.Tensor, lb: float | None,
               ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if a.device.type == "cuda":
        return _gpu_pair(a, m, lb, ub)
    return reference(torch.cat((a, m), -1), a.shape[-1], lb, ub)


def _register(name: str, body):
    """The operator `name`, registered when this module is imported (a warm-start package made by another process
    calls it by name); None, with the reason, where this torch cannot register it."""

    if importlib.util.find_spec("triton") is None:
        return None, "Triton is not installed (the fused kernel is a Triton kernel)"
    namespace, _, op = name.partition("::")
    registered = getattr(getattr(torch.ops, namespace, None), op, None)
    if registered is not None:  # this module imported again under another package name: the same operator
        return registered, ""
    try:
        return triton_op(name, mutates_args=())(body), ""
    except Exception as e:  # noqa: BLE001 -- an older or newer torch: fusion is then off, and the report says why
        return None, f"torch {torch.__version__} could not register the {name} operator ({type(e).__name__}: {e})"


def _silu_body(x: torch.Tensor, gate_from: int, lb: float | None,
               ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cuda":
        return _gpu_silu(x, gate_from, lb, ub)
    return silu_gate_reference(x, gate_from, lb, ub)


def _silu_pair_body(a: torch.Tensor, m: torch.Tensor, lb: float | None,
                    ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if a.device.type == "cuda":
        return _gpu_silu_pair(a, m, lb, ub)
    return silu_gate_reference(torch.cat((a, m), -1), a.shape[-1], lb, ub)


_OP, UNAVAILABLE = _register(OP_NAME, _op_body)
_PAIR_OP, PAIR_UNAVAILABLE = _register(PAIR_OP_NAME, _pair_body)
_SILU_OP, SILU_UNAVAILABLE = _register(SILU_OP_NAME, _silu_body)
_SILU_PAIR_OP, SILU_PAIR_UNAVAILABLE = _register(SILU_PAIR_OP_NAME, _silu_pair_body)


def gelu_rowwise_fp8(x: torch.Tensor, gelu_from: int = 0, lb: float | None = None, ub: float | None = None):
    """(q, scale): x (..., N) in bf16 with GELU(tanh) applied from column `gelu_from` on, quantized to FP8 e4m3 with
    one scale per row (float32, shape (rows, 1)); q has shape (rows, N)."""
    if _OP is None:
        raise RuntimeError(UNAVAILABLE)
    return _OP(_rows(x), int(gelu_from), lb, ub)


def gelu_pair_rowwise_fp8(a: torch.Tensor, m: torch.Tensor, lb: float | None = None, ub: float | None = None):
    """gelu_rowwise_fp8 of the row [a | m] with GELU from a's end on (`a` kept, GELU applied to `m`), read from a
    (..., Na) and m (..., Nm) where they are: (q (rows, Na + Nm), scale (rows, 1))."""
    if _PAIR_OP is None:
        raise RuntimeError(PAIR_UNAVAILABLE)
    return _PAIR_OP(_rows(a), _rows(m), lb, ub)


def silu_gate_rowwise_fp8(x: torch.Tensor, gate_from: int = 0, lb: float | None = None, ub: float | None = None):
    """(q, scale): x (..., gate_from + 2 H) in bf16 as [x0 | SiLU(m1) * m2] (silu_gate_columns), quantized to FP8 e4m3
    with one scale per row (float32, (rows, 1)); q has shape (rows, gate_from + H)."""
    if _SILU_OP is None:
        raise RuntimeError(SILU_UNAVAILABLE)
    return _SILU_OP(_rows(x), int(gate_from), lb, ub)


def silu_gate_pair_rowwise_fp8(a: torch.Tensor, m: torch.Tensor, lb: float | None = None, ub: float | None = None):
    """silu_gate_rowwise_fp8 of the row [a | m] with the gate from a's end on, read from a (..., Na) and m (..., 2 H)
    where they are: (q (rows, Na + H), scale (rows, 1))."""
    if _SILU_PAIR_OP is None:
        raise RuntimeError(SILU_PAIR_UNAVAILABLE)
    return _SILU_PAIR_OP(_rows(a), _rows(m), lb, ub)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, columns) with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
