"""Each kind of FLUX block compiled once, on its own, and called for every block of that kind.

FLUX.1 runs 19 identical double-stream and 38 identical single-stream blocks (FLUX.2 and Chroma likewise). Each kind's
body is one torch.compile (inductor; with FluxAccel's CUDA-graph capture, its C++ wrapper: config.inductor_options),
traced once and called with each block of its kind; the model around the blocks runs as ComfyUI's own code, and the
whole model call is captured into one CUDA graph by call_graphs.py where it can be.

How the blocks get in without touching the loaded model: ComfyUI's FLUX forward looks up
transformer_options["patches_replace"]["dit"][("double_block", i)] for every block. The compiled call passes a
table of replacements that call the same block through the compiled body. Nothing is set on the module itself,
so other workflow branches using the same model run the original code.

What a compiled body needs:
  * the blocks add their residuals in place (img += ...); the body clones its inputs first, so that the caller's
    tensors are never written (inductor folds the copy into the add);
  * FLUX.2 and Chroma hand every block its modulation as ModulationOut records whose tensors are slices of one
    tensor (computed once per call, outside the blocks); they are passed as plain tensors with a constant layout and
    the records rebuilt inside (a dataclass instance per call would be a new guard);
  * transformer_options carries block_index (a different constant per block): the body would be specialised
    per block and never reused. Nothing inside a FLUX block reads it, so it is left out; so is our own replacement
    table; FluxAccel's attention override (a function) is put back inside the body rather than passed in.

A single block runs FluxAccel's forward of it (single_block.py: no concatenation written before linear2) where the
block is one that forward was written for; any other block, its own forward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch

from ..cache.packages import Call
from ..upstream import Unavailable, say, torch_internals

from . import single_block
from .attention import OVERRIDE_KEY
from .fp8_attention import SCALES_KEY, qk_scales
from .options import OWN_ATTENTION  # the override a body puts back, by the name it takes (a constant input)

DOUBLE = "double_block"
SINGLE = "single_block"
_PER_BLOCK_KEYS = ("block_index", "patches_replace")


def _double_body(block, img, txt, vec_layout, vec_tensors, pe, attn_mask, transformer_options, own_attention):
    return block(img=img.clone(), txt=txt.clone(), vec=_rebuilt(vec_layout, vec_tensors), pe=pe, attn_mask=attn_mask,
                 transformer_options=_with_attention(block, transformer_options, own_attention))


def _single_body(block, img, vec_layout, vec_tensors, pe, attn_mask, transformer_options, own_attention,
                 own_forward):
    kwargs = dict(vec=_rebuilt(vec_layout, vec_tensors), pe=pe, attn_mask=attn_mask,
                  transformer_options=_with_attention(block, transformer_options, own_attention))
    if own_forward:  # FluxAccel's forward: no concatenation written before linear2 (single_block.py)
        return single_block.forward(block, img.clone(), **kwargs)
    return block(img.clone(), **kwargs)


def _with_attention(block, options: dict, own_attention: str) -> dict:
    """FluxAccel's attention override is put back inside the body rather than passed in (see the module's notes);
    FP8 attention also takes this block's Q/K scales from its QK-norm weights (fp8_attention.py)."""
    if not own_attention:
        return options
    out = {**options, OVERRIDE_KEY: OWN_ATTENTION[own_attention]}
    if own_attention == "fp8":
        scales = qk_scales(block)
        if scales is not None:
            out[SCALES_KEY] = scales
    return out


_RECORDS: dict[str, type] = {}  # the modulation record classes met, by name (a body rebuilds them from the name)


def _flat(vec, nested: bool = False) -> tuple:
    """(layout, tensors): vec as constants and tensors only, which one trace serves for every block. FLUX.1's vector
    as it is; FLUX.2's and Chroma's modulation records (slices of one tensor) as copies of their tensors."""
    if isinstance(vec, torch.Tensor):
        return "tensor", (vec.clone() if nested else vec,)
    if vec is None:
        return "none", ()
    if isinstance(vec, (tuple, list)):
        parts = [_flat(v, nested=True) for v in vec]
        return (type(vec).__name__, tuple(p[0] for p in parts)), tuple(t for p in parts for t in p[1])
    if dataclasses.is_dataclass(vec):
        name = f"{type(vec).__module__}.{type(vec).__qualname__}"
        if _RECORDS.get(name) is not type(vec):  # known before the trace (_known_records): no guard on a new key
            _RECORDS[name] = type(vec)
        fields = tuple(f.name for f in dataclasses.fields(vec))
        return ("record", name, fields), tuple(getattr(vec, f).clone() for f in fields)
    raise TypeError(f"FluxAccel: a FLUX block's vec of type {type(vec).__name__} is not known")


def _known_records(dm: torch.nn.Module) -> None:
    """The dataclasses the modules of the model and its blocks define or import (FLUX.2's and Chroma's modulation
    records among them), in _RECORDS before any trace: a key the first traced call added would fail the trace's
    guard on the dict at the next call (one more compile)."""
    classes = {type(dm), *(type(b) for b in (*getattr(dm, "double_blocks", ()), *getattr(dm, "single_blocks", ())))}
    for cls in classes:
        for v in list(getattr(sys.modules.get(cls.__module__), "__dict__", {}).values()):
            if isinstance(v, type) and dataclasses.is_dataclass(v):
                _RECORDS.setdefault(f"{v.__module__}.{v.__qualname__}", v)


def _rebuilt(layout, tensors: tuple):
    """_flat's inverse (inside the compiled body)."""
    return _take(layout, tensors, 0)[0]


def _take(layout, tensors: tuple, i: int):
    if layout == "tensor":
        return tensors[i], i + 1
    if layout == "none":
        return None, i
    if layout[0] == "record":
        _, name, fields = layout
        return _RECORDS[name](**dict(zip(fields, tensors[i:i + len(fields)]))), i + len(fields)
    kind, parts = layout
    items = []
    for part in parts:
        item, i = _take(part, tensors, i)
        items.append(item)
    return (list(items) if kind == "list" else tuple(items)), i


def _shared_options(options: dict | None) -> tuple[dict, str]:
    """(the options every block of a kind shares, the name of FluxAccel's attention override in them or '')."""
    shared = {k: v for k, v in (options or {}).items() if k not in _PER_BLOCK_KEYS}
    own = next((name for name, fn in OWN_ATTENTION.items() if shared.get(OVERRIDE_KEY) is fn), "")
    if own:
        del shared[OVERRIDE_KEY]
    return shared, own


def _tokens_dynamic(args: dict) -> None:
    """Mark the token dimension of a block's inputs dynamic (BlockTable's dynamic_tokens): one trace for every count."""
    for name, dim in (("img", 1), ("txt", 1), ("pe", 2)):
        if isinstance(args.get(name), torch.Tensor):
            marked = torch_internals.mark_dynamic(args[name], dim)
            if isinstance(marked, Unavailable):
                say(marked, "each token count compiles on its own")


def _double_replacement(block, double, dynamic: bool = False):
    def replace(args, extra):
        if dynamic:
            _tokens_dynamic(args)
        img, txt = double(block, args["img"], args["txt"], *_flat(args["vec"]), args["pe"], args.get("attn_mask"),
                          *_shared_options(args.get("transformer_options")))
        return {"img": img, "txt": txt}

    return replace


def _single_replacement(block, own_forward: bool, single, dynamic: bool = False):
    def replace(args, extra):
        if dynamic:
            _tokens_dynamic(args)
        img = single(block, args["img"], *_flat(args["vec"]), args["pe"], args.get("attn_mask"),
                     *_shared_options(args.get("transformer_options")), own_forward and single_block.ready(block))
        return {"img": img}

    return replace


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One kind of block at one shape: what a per-block warm-start package stands for (its outcome's key)."""

    shape: object  # the call's ShapeKey (in a separate compile process: the call's signature)
    kind: str

    def describe(self) -> str:
        at = self.shape.describe() if hasattr(self.shape, "describe") else \
            f"call {self.shape}" if self.shape is not None else "an unnamed shape"
        return f"{self.kind} blocks at {at}"


class _Packaged:
    """A block body compiled through warm-start packages (one per block kind and call signature): loaded in a
    restarted ComfyUI instead of traced again; torch.compile where a call cannot have one (the log says why)."""

    def __init__(self, fn, fn_compiled, packages, table):
        self.fn, self.fn_compiled, self.packages, self.table = fn, fn_compiled, packages, table
        self.kind = DOUBLE if fn is _double_body else SINGLE

    def __call__(self, block, *args):
        package = self.packages.get(BlockCall(self.table.shape, self.kind), Call(block, args, {}, self.fn),
                                    self.table.loading)
        return self.fn_compiled(block, *args) if package is None else package(block, *args)


class BlockTable:
    """The patches_replace table of one FLUX diffusion model, each kind of block compiled once with `options`
    (inductor's), through warm-start packages where `packages` (warm_start.Packages) is given; rebuilt only if the
    model's blocks are swapped."""

    def __init__(self, dm: torch.nn.Module, options: dict, packages=None, dynamic_tokens: bool = False):
        self._dm, self.dynamic_tokens = dm, dynamic_tokens
        _known_records(dm)
        self.shape = None  # the shape key of the call running (set by the runner; per-block packages name it)
        self.loading = contextlib.nullcontext  # the running call's package-load marker (set by the runner)
        self._blocks: tuple = ()
        self._table: dict = {}

        def compiled(fn):
            fn_compiled = torch.compile(fn, backend="inductor", dynamic=None if dynamic_tokens else False,
                                        fullgraph=True, options=options)
            return fn_compiled if packages is None else _Packaged(fn, fn_compiled, packages, self)

        self._double, self._single = compiled(_double_body), compiled(_single_body)

    def table(self) -> dict:
        blocks = (*self._dm.double_blocks, *self._dm.single_blocks)
        if len(blocks) != len(self._blocks) or any(a is not b for a, b in zip(blocks, self._blocks)):
            n = len(self._dm.double_blocks)
            self._blocks = blocks
            self._table = {(DOUBLE, i): _double_replacement(b, self._double, self.dynamic_tokens)
                           for i, b in enumerate(blocks[:n])}
            # per block class: whether FluxAccel's single-block forward was written for it
            own = {cls: not single_block.known(cls) for cls in {type(b) for b in blocks[n:]}}
            self._table.update({(SINGLE, i): _single_replacement(b, own.get(type(b), False), self._single,
                                                                 self.dynamic_tokens)
                                for i, b in enumerate(blocks[n:])})
        return self._table

    def transformer_options(self) -> dict:
        """A fresh options dict per call (the model writes block_index etc. into it) around the cached table."""
        return {"patches_replace": {"dit": self.table()}}
