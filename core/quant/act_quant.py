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
or an FP8 value differs from torch's in its last bit now and then (bench/probes/flux_blocks.py --fused counts them).
Off the GPU the op runs the same in torch.

`gelu_pair_rowwise_fp8` quantizes the same row read from two tensors, [a | GELU(m)]: the single block's attention
output and MLP stream, so that FluxAccel's single-block forward (compile/single_block.py) never writes their
concatenation. Its numbers are the one-input op's on the concatenated row.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest value
MAX_ROW = 32768  # the widest row one program holds in registers (FLUX.1's MLPs: 12,288 and 15,360)
OP_NAME = "fluxaccel::gelu_rowwise_fp8"
PAIR_OP_NAME = "fluxaccel::gelu_pair_rowwise_fp8"


def gelu_columns(x: torch.Tensor, gelu_from: int) -> torch.Tensor:
    """x with GELU(tanh) applied to its last dimension's columns from `gelu_from` on (in x's dtype, as eager)."""
    gelu = torch.nn.functional.gelu(x[..., gelu_from:], approximate="tanh")
    return torch.cat([x[..., :gelu_from], gelu], -1) if gelu_from else gelu


def reference(x: torch.Tensor, gelu_from: int, lb: float | None = None, ub: float | None = None):
    """(q, scale) of x (M, N): GELU(tanh) on the columns from `gelu_from` on, then torchao's row-wise FP8."""
    h = gelu_columns(x, gelu_from)
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


WARPS_PER_ELEMENTS = 1024  # one warp per this many elements of a row (4 to 32 warps): see num_warps


def num_warps(block: int) -> int:
    """Warps per row program: enough threads that a row's elements fit in registers (H200: bench/NOTES.md)."""
    return min(32, max(4, block // WARPS_PER_ELEMENTS))


def _gpu(x, gelu_from, lb, ub):
    import triton
    from torch.library import wrap_triton

    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(n)
    wrap_triton(_kernel())[(m,)](x, q, s, n, x.stride(0), q.stride(0), 0.0 if lb is None else lb,
                                 0.0 if ub is None else ub, GELU_FROM=gelu_from, HAS_LB=lb is not None,
                                 HAS_UB=ub is not None, BLOCK=block, num_warps=num_warps(block))
    return q, s


def _gpu_pair(a, m, lb, ub):
    import triton
    from torch.library import wrap_triton

    rows, n_a = a.shape
    n_m = m.shape[1]
    q = torch.empty((rows, n_a + n_m), device=a.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=a.device, dtype=torch.float32)
    block_a, block_m = triton.next_power_of_2(n_a), triton.next_power_of_2(n_m)
    wrap_triton(_kernel("gelu_pair_rowwise_fp8_kernel"))[(rows,)](
        a, m, q, s, n_a, n_m, a.stride(0), m.stride(0), q.stride(0), 0.0 if lb is None else lb,
        0.0 if ub is None else ub, HAS_LB=lb is not None, HAS_UB=ub is not None, BLOCK_A=block_a, BLOCK_M=block_m,
        num_warps=num_warps(max(block_a, block_m)))
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
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None, "Triton is not installed (the fused kernel is a Triton kernel)"
    namespace, _, op = name.partition("::")
    registered = getattr(getattr(torch.ops, namespace, None), op, None)
    if registered is not None:  # this module imported again under another package name: the same operator
        return registered, ""
    try:
        from torch.library import triton_op

        return triton_op(name, mutates_args=())(body), ""
    except Exception as e:  # noqa: BLE001 -- an older or newer torch: fusion is then off, and the report says why
        return None, f"torch {torch.__version__} could not register the {name} operator ({type(e).__name__}: {e})"


_OP, UNAVAILABLE = _register(OP_NAME, _op_body)
_PAIR_OP, PAIR_UNAVAILABLE = _register(PAIR_OP_NAME, _pair_body)


def gelu_rowwise_fp8(x: torch.Tensor, gelu_from: int = 0, lb: float | None = None, ub: float | None = None):
    """(q, scale): x (..., N) in bf16 with GELU(tanh) applied from column `gelu_from` on, quantized to FP8 e4m3 with
    one scale per row (float32, shape (rows, 1)); q has shape (rows, N)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if _OP is None:
        raise RuntimeError(UNAVAILABLE)
    return _OP(x2, int(gelu_from), lb, ub)


def gelu_pair_rowwise_fp8(a: torch.Tensor, m: torch.Tensor, lb: float | None = None, ub: float | None = None):
    """gelu_rowwise_fp8 of the row [a | m] with GELU from a's end on (`a` kept, GELU applied to `m`), read from a
    (..., Na) and m (..., Nm) where they are: (q (rows, Na + Nm), scale (rows, 1))."""
    a2, m2 = a.reshape(-1, a.shape[-1]), m.reshape(-1, m.shape[-1])
    a2, m2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (a2, m2))
    if _PAIR_OP is None:
        raise RuntimeError(PAIR_UNAVAILABLE)
    return _PAIR_OP(a2, m2, lb, ub)
