"""Repeated-block regions inside the whole-model compile: each kind of FLUX block is compiled once and reused.

FLUX.1 runs 19 identical double-stream and 38 identical single-stream blocks. A whole-model torch.compile traces,
lowers and Triton-compiles all 57 of them; `torch.compiler.nested_compile_region` marks a block as a region that
the compiler builds once per kind and calls again for the other blocks (hierarchical compilation). The model is
still ONE compiled graph, so CUDA graphs still capture the whole model call (unlike per-block compile).

How the regions get in without touching the loaded model: ComfyUI's FLUX forward looks up
transformer_options["patches_replace"]["dit"][("double_block", i)] for every block. The compiled call passes a
table of replacements that call the same block through a region function. Nothing is set on the module itself,
so other workflow branches using the same model run the original code.

What the region needs:
  * the blocks add their residuals in place (img += ...); a region must not mutate its inputs, so it clones
    them first (inductor folds the copy into the add: same bytes as the in-place add);
  * FLUX.2 and Chroma hand every block its modulation as ModulationOut records whose tensors are slices of one
    tensor (computed once per call, outside the blocks); a region takes no inputs that alias each other, so those
    slices are copied before the call (a few KB per block; FLUX.1's per-block modulation is computed inside), and
    passed as plain tensors with a constant layout, the records rebuilt inside (see the last point);
  * transformer_options carries block_index (a different constant per block): the region would be specialised
    per block and never reused. Nothing inside a FLUX block reads it (ComfyUI 0.3.75), so it is left out; so is
    our own replacement table;
  * torch 2.12+ traces a region once and stamps that trace out for the next blocks, if its inputs are tensors,
    constants or objects it can guard: FluxAccel's attention override (a function) is therefore put back into the
    options inside the region instead of passed in, and modulation records are passed as tensors (CPU, torch 2.14,
    19 + 38 blocks: tracing 13.9 -> 5.2 s).

A single block's region runs FluxAccel's own forward of it (single_block.py: no concatenation written before linear2)
where the config asks for it and the block is one that forward was written for; any other block, its own forward.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from . import single_block
from .attention import OVERRIDE_KEY
from .fp8_attention import SCALES_KEY, qk_scales
from .options import OWN_ATTENTION  # the override a region puts back, by the name it takes (a constant input)

DOUBLE = "double_block"
SINGLE = "single_block"
_PER_BLOCK_KEYS = ("block_index", "patches_replace")


def available() -> bool:
    return hasattr(torch.compiler, "nested_compile_region")


def _region(fn):
    return torch.compiler.nested_compile_region(fn) if available() else fn


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


_double, _single = _region(_double_body), _region(_single_body)


def _with_attention(block, options: dict, own_attention: str) -> dict:
    """FluxAccel's attention override is put back inside the region rather than passed in (see the module's notes);
    FP8 attention also takes this block's Q/K scales from its QK-norm weights (fp8_attention.py)."""
    if not own_attention:
        return options
    out = {**options, OVERRIDE_KEY: OWN_ATTENTION[own_attention]}
    if own_attention == "fp8":
        scales = qk_scales(block)
        if scales is not None:
            out[SCALES_KEY] = scales
    return out


_RECORDS: dict[str, type] = {}  # the modulation record classes met, by name (a region rebuilds them from the name)


def _flat(vec, nested: bool = False) -> tuple:
    """(layout, tensors): vec as constants and tensors only, which torch can reuse a region's trace for. FLUX.1's
    vector as it is; FLUX.2's and Chroma's modulation records (slices of one tensor, which a region may not take as
    aliasing inputs) as copies of their tensors."""
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
    raise TypeError(f"block_regions: a FLUX block's vec of type {type(vec).__name__} is not known")


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
    """_flat's inverse (inside the region)."""
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


def _double_replacement(block, double=_double):
    def replace(args, extra):
        img, txt = double(block, args["img"], args["txt"], *_flat(args["vec"]), args["pe"], args.get("attn_mask"),
                          *_shared_options(args.get("transformer_options")))
        return {"img": img, "txt": txt}

    return replace


def _single_replacement(block, own_forward: bool, single=_single):
    def replace(args, extra):
        img = single(block, args["img"], *_flat(args["vec"]), args["pe"], args.get("attn_mask"),
                     *_shared_options(args.get("transformer_options")), own_forward and single_block.ready(block))
        return {"img": img}

    return replace


def for_config(dm: torch.nn.Module, cfg, device: torch.device, packages=None) -> "BlockRegions | None":
    """The block table a compile config asks for (None without block_regions): nested regions inside the whole-model
    compile, or with graph_capture "call" each kind of block compiled on its own (inductor's C++ wrapper, which
    refuses nested regions; the model around the blocks runs uncompiled and FluxAccel captures the whole call), through
    warm-start packages where `packages` (warm_start.Packages) is given."""
    if not cfg.block_regions:
        return None
    if cfg.nested_regions:
        return BlockRegions(dm, cfg.single_blocks)
    options = cfg.inductor_options(device)

    def compiled(fn):
        fn_compiled = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True, options=options)
        return fn_compiled if packages is None else _Packaged(fn, fn_compiled, packages, lambda: regions.shape,
                                                              lambda: regions.loading)

    regions = BlockRegions(dm, cfg.single_blocks, compile_blocks=compiled)
    return regions


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

    def __init__(self, fn, fn_compiled, packages, shape, loading):
        # shape(): the call's shape key; loading(): the context that marks a package load in the compile's progress
        self.fn, self.fn_compiled, self.packages, self.shape, self.loading = fn, fn_compiled, packages, shape, loading
        self.kind = DOUBLE if fn is _double_body else SINGLE

    def __call__(self, block, *args):
        package = self.packages.get(BlockCall(self.shape(), self.kind), block, args, {}, self.loading(), fn=self.fn)
        return self.fn_compiled(block, *args) if package is None else package(block, *args)


class BlockRegions:
    """The patches_replace table for one FLUX diffusion model, rebuilt only if its blocks are swapped. single_blocks:
    "fluxaccel" runs FluxAccel's single-block forward where it applies (single_block.py), "comfyui" the block's own."""

    def __init__(self, dm: torch.nn.Module, single_blocks: str = "comfyui", compile_blocks=None):
        self._dm = dm
        _known_records(dm)
        self.shape = None  # the shape key of the call running (set by the runner; per-block packages name it)
        self.loading = None  # the running call's package-load marker (set by the runner; per-block packages use it)
        self._own_single = single_blocks == "fluxaccel"
        self._blocks: tuple = ()
        self._table: dict = {}
        # compile_blocks(fn) -> compiled fn: each block kind compiled on its own (the model around them runs eager),
        # instead of nested regions inside a whole-model compile
        self._double, self._single = (_double, _single) if compile_blocks is None else \
            (compile_blocks(_double_body), compile_blocks(_single_body))

    def table(self) -> dict:
        blocks = (*self._dm.double_blocks, *self._dm.single_blocks)
        if len(blocks) != len(self._blocks) or any(a is not b for a, b in zip(blocks, self._blocks)):
            n = len(self._dm.double_blocks)
            self._blocks = blocks
            self._table = {(DOUBLE, i): _double_replacement(b, self._double) for i, b in enumerate(blocks[:n])}
            own = {cls: not single_block.known(cls) for cls in {type(b) for b in blocks[n:]}} if self._own_single \
                else {}  # per block class: whether FluxAccel's single-block forward was written for it
            self._table.update({(SINGLE, i): _single_replacement(b, own.get(type(b), False), self._single)
                                for i, b in enumerate(blocks[n:])})
        return self._table

    def transformer_options(self) -> dict:
        """A fresh options dict per call (the model writes block_index etc. into it) around the cached table."""
        return {"patches_replace": {"dit": self.table()}}
