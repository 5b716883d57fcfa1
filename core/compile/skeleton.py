"""A model call without its data: the module tree and the call's inputs pickled with every tensor replaced by its
shape, strides and dtype, rebuilt in another process as zero-filled tensors on its device.

What a compile depends on is the module tree (classes, attributes, which tensors it holds and how they are laid out)
and the inputs' layout, never the values: a separate process can compile a model's call from its skeleton alone
(separate.py), without reading the weights file again or holding the weights in host memory.

Classes are pickled by reference (ComfyUI's op classes, FluxAccel's): a class made inside a function (ComfyUI's
mixed-precision ops for checkpoint-quantized models) cannot be, and the pickle fails with a message naming it.
FluxAccel's FP8 Linear classes are made per ComfyUI op class at run time; they are rebuilt the same way.
"""
from __future__ import annotations

import io
import pickle
import types
from dataclasses import dataclass

import torch

from ..quant.linear import fp8_class_origin, rebuild_fp8_class


class NotPortable(ValueError):
    """Something in the model or the call that another process cannot rebuild (the message says what)."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor by layout: rebuilt as zeros of this shape, strides and dtype (a Parameter where it was one)."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device_type: str
    parameter: bool
    requires_grad: bool

    def nbytes(self) -> int:
        size = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        return size * self.dtype.itemsize


def _bound(fn, obj):
    return types.MethodType(fn, obj)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or type(obj.data) is not torch.Tensor:
                raise NotPortable(f"a {type(obj).__name__} tensor (only plain tensors can be rebuilt by layout)")
            return TensorSpec(tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device.type,
                              isinstance(obj, torch.nn.Parameter), obj.requires_grad)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, type):
            origin = fp8_class_origin(obj)
            if origin is not None:
                return rebuild_fp8_class, (origin,)
        if isinstance(obj, types.MethodType) and not hasattr(obj.__func__, "__name__"):
            # a callable object bound to a module (torchao sets extra_repr so on the Linears it quantizes): pickled as
            # the pair, where pickle's default looks the method up by a name it does not have
            return _bound, (obj.__func__, obj.__self__)
        return NotImplemented


def dumps(obj) -> tuple[bytes, int]:
    """(the pickled skeleton of obj, bytes its tensors take when rebuilt); NotPortable where it cannot be made."""
    specs: list[TensorSpec] = []

    class Counting(_Pickler):
        def persistent_id(self, o):
            spec = super().persistent_id(o)
            if spec is not None:
                specs.append(spec)
            return spec

    buf = io.BytesIO()
    try:
        Counting(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise NotPortable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]) from e
    return buf.getvalue(), sum(s.nbytes() for s in specs)


def loads(payload: bytes, device: torch.device):
    """The object back, every tensor a zero-filled one of its layout on `device` (CPU tensors stay on the CPU)."""
    device = torch.device(device)

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, spec: TensorSpec):
            where = device if spec.device_type == device.type else torch.device(spec.device_type)
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=where)
            if t.numel():
                t.zero_()
            if spec.parameter:
                return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
            return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t

    return Unpickler(io.BytesIO(payload)).load()
