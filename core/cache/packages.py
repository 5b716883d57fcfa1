"""Warm-start packages: each compiled block kind and shape saved with dynamo's trace, so that a restarted ComfyUI runs
without tracing again.

The kernel cache (kernels.py) keeps inductor's artifacts, but every new process still re-traces the blocks
with dynamo and rebuilds its guards, most of a cached start's time. A warm-start package is
`torch.compile(...).aot_compile()`'s output instead: the traced bytecode and the compiled graph of one call signature,
loaded in a new process and called with the live model as its `self` -- its weights are read from the loaded
model at each call (LoRA-merged and FP8 weights stay ComfyUI's), nothing is baked into the file.

Guards. dynamo would check the module tree's types on each call; ComfyUI's op classes (comfy.ops.*.Linear, ...)
are nested classes, which dynamo refuses to save ("defined in local scope"). A package therefore keeps no dynamo
guards, and FluxAccel checks what they would have: the file's key holds the compile cache's key (torch, triton,
torchao versions, GPU, compile config, model layout, FP8 config) and the call signature (every input's shape, dtype
and device, the options FLUX reads, grad/inference mode); a call with another signature gets its own package. On
load, the sources the trace inlined (ComfyUI's FLUX code, FluxAccel's attention and rope) are compared with the ones
running now: a changed source makes the package stale.

Files sit next to the compile cache (`<key>-<signature>.warm`), written under a temporary name and renamed, so
workers sharing a folder never read half a file; a stale, foreign or corrupt file is ignored with a warning and the
shape compiles again (and its package is rewritten).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import sys
import threading
import time
import tokenize
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..upstream import Unavailable, torch_internals
from .folder import UNUSABLE_FILE, UNWRITABLE

log = logging.getLogger("fluxaccel.cache")

MAGIC = b"FLUXACCEL-WARM-START 1\n"

SUFFIX = ".warm"
# what torch reads from inductor's config when it loads a package (the rest of the compile's options shaped the saved
# graph already): a load in the background may only run where these equal the process's config, since a patch of
# inductor's config is seen by every thread
LOAD_OPTIONS = ("triton.cudagraphs",)
# what a load in the background sets for its own duration: the C++ wrapper's CPU vector ISA (config.py), which a load
# reads to find the wrapper's built library. Seen by every thread meanwhile, it only stops another thread's CPU
# compile from vectorizing (its GPU code is as before), and the ISA list computed then is dropped after
# (vec_isa_list_kept)
BACKGROUND_OPTIONS = ("cpp.vec_isa_ok",)
# torch's compile and package loading share inductor's caches: FluxAccel runs them one at a time in this process
TORCH_COMPILE_LOCK = threading.RLock()

# packages this process has "loaded" for its calls (taken into use; one loaded in the background and never called is
# not counted): a loaded one runs without dynamo tracing anything, so dynamo's counters do not see it (with them,
# they count the compiled graphs a process has made)
counts: collections.Counter = collections.Counter()


def available() -> tuple[bool, str]:
    """(usable, why not): torch's AOT compile of a dynamo trace (torch 2.9 or newer)."""
    ok = torch_internals.aot_compile_available()
    return (True, "") if ok is True else (False, str(ok))


class NotPackageable(ValueError):
    """A call input that a package cannot stand for in another process (the call is traced by torch.compile)."""


def _describe(value: Any, where: str) -> Any:
    """A value's part of a call signature: tensors by shape/dtype/device, module-level functions by qualified name.
    A closure, lambda, bound method or other callable object (e.g. an attention override holding its settings) may
    compute differently under the same name in the next process: refused, so the call keeps dynamo's guards."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}:{tuple(value.stride())}:{value.dtype}:{value.device}:{value.requires_grad}"
    if isinstance(value, dict):
        return {str(k): _describe(v, f"{where}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if callable(value):
        qual = getattr(value, "__qualname__", "")
        if not isinstance(value, types.FunctionType) or value.__closure__ or "<" in qual:
            raise NotPackageable(f"{where} is {value!r}, not a module-level function")
        return f"{value.__module__}.{qual}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise NotPackageable(f"{where} is a {type(value).__name__}")


def call_description(args: tuple, kwargs: dict) -> dict:
    """A call's inputs by structure (see _describe) and the autograd mode it runs under."""
    return {"args": _describe(args, "args"), "kwargs": _describe(kwargs, "kwargs"), "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled()}


def signature(args: tuple, kwargs: dict) -> str:
    """What one package is valid for, besides the cache key: the inputs' structure and the autograd mode."""
    return hashlib.sha256(json.dumps(call_description(args, kwargs), sort_keys=True).encode()).hexdigest()[:16]


def portable(kwargs: dict) -> dict:
    """A compiled call's keyword arguments as a package stands for them: without the block regions' table, which holds
    closures rebuilt in each process (the compile config, in the key, fixes it)."""
    opts = kwargs.get("transformer_options") or {}
    return {**kwargs, "transformer_options": {k: v for k, v in opts.items() if k != "patches_replace"}}


def _no_guards(entries) -> list[bool]:
    # see the module docstring: FluxAccel's key and signature stand in for dynamo's guards
    return [False] * len(entries)


@dataclass(frozen=True)
class Call:
    """One call to compile: dm's class's forward with dm passed as self, or `fn`, a module-level function taking dm
    first (e.g. a block's body)."""

    dm: torch.nn.Module
    args: tuple
    kwargs: dict
    fn: Callable | None = None

    def signature(self) -> str:
        """The package's call signature (signature() of the call; fn's and dm's names are part of it)."""
        named = self.args if self.fn is None else (f"{self.fn.__module__}.{self.fn.__qualname__}",
                                                   f"{type(self.dm).__module__}.{type(self.dm).__qualname__}",
                                                   *self.args)
        return signature(named, portable(self.kwargs))


def aot_compile(call: Call, options: dict) -> Callable:
    """Trace and compile one call ahead of running it."""
    # torch 2.9-2.11: off by default, and read when torch.compile wraps the function (for this call only)
    with TORCH_COMPILE_LOCK, torch_internals.enable_aot_compile(), torch_internals.vec_isa_list_kept():
        target = torch.compile(call.fn or type(call.dm).forward, backend="inductor", fullgraph=True, dynamic=False,
                               options={**options, "guard_filter_fn": _no_guards})
        compiled = target.aot_compile(((call.dm, *call.args), call.kwargs))
    _skip_guard_check(compiled)
    return compiled


def _skip_guard_check(fn) -> None:
    """A package holds no guards (see above): skip binding each call's arguments to check none (where torch has it)."""
    off = getattr(fn, "disable_guard_check", None)
    if off is not None:
        off()


def _source_digests(fn) -> dict[str, str]:
    """module -> sha256 of its source, for every module the trace inlined code from."""
    out = {}
    for s in fn.source_info().inlined_sources:
        out[s.module] = hashlib.sha256(s.content.encode()).hexdigest()
    return out


def _module_digest(name: str) -> str | None:
    """sha256 of an imported module's source as inspect.getsource gives it (the text torch saved: the file decoded,
    universal newlines, a final newline), read from its file. Not through inspect: it reads linecache, which other
    threads (a package loading in the background, a traceback being formatted) check and clear meanwhile, and a
    read that loses that race would call an unchanged package stale. None where the module is not imported or has
    no source file."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        with tokenize.open(path) as f:
            text = f.read()
    except (OSError, SyntaxError, UnicodeDecodeError):  # SyntaxError: tokenize's reading of an encoding cookie
        return None
    if not text.endswith("\n"):  # as linecache reads it: an empty file is one empty line
        text += "\n"
    return hashlib.sha256(text.encode()).hexdigest()


def _stale_sources(saved: dict[str, str]) -> tuple[list[str], list[str]]:
    """(the modules whose source changed since the package was written, those whose source cannot be read here)."""
    changed, unread = [], []
    for name, digest in saved.items():
        now = _module_digest(name)
        if now is None:
            unread.append(name)
        elif now != digest:
            changed.append(name)
    return changed, unread


class WarmStart:
    """The warm-start packages of one compiled model (one cache key), one file per call signature."""

    def __init__(self, key: str, directory: Path):
        self.key = key
        self.dir = Path(directory)

    def path(self, sig: str) -> Path:
        return self.dir / f"{self.key}-{sig}{SUFFIX}"

    def signatures(self) -> list[str]:
        """The call signatures with a package on disk, the newest first (a load leaves the files as they are)."""
        try:
            found = [(p.stat().st_mtime, p.name[len(self.key) + 1:-len(SUFFIX)])
                     for p in self.dir.glob(f"{self.key}-*{SUFFIX}")]
        except OSError:
            return []
        return [sig for _, sig in sorted(found, reverse=True)]

    def load(self, sig: str, options: dict | None = None) -> Callable | None:
        """The saved compiled call for this signature, or None (with a warning if a file was there but unusable).
        options: the compile's inductor options, in force while loading only: torch wraps the loaded graph in CUDA
        graphs from the config it reads then (triton.cudagraphs), not from the saved compile's options."""
        path = self.path(sig)
        if not path.is_file():
            return None
        try:
            t0 = time.perf_counter()
            blob = path.read_bytes()
            if not blob.startswith(MAGIC):
                raise ValueError("not a FluxAccel warm-start file")
            header, _, payload = blob[len(MAGIC):].partition(b"\n")
            meta = json.loads(header)
            if meta.get("key") != self.key or meta.get("signature") != sig:
                raise ValueError("written for another model/version/config/call signature")
            changed, unread = _stale_sources(meta.get("sources") or {})
            if changed:
                raise ValueError(f"stale: the source of {', '.join(changed)} changed since it was written")
            if unread:
                raise ValueError(f"cannot tell whether it is stale: the source of {', '.join(unread)} cannot be read "
                                 "in this process")
            with TORCH_COMPILE_LOCK, torch_internals.inductor_config_patch(options), \
                    torch_internals.vec_isa_list_kept():
                fn = torch.compiler.load_compiled_function(io.BytesIO(payload))
            _skip_guard_check(fn)
            log.info("FluxAccel: loaded warm-start package %s in %.2f s (no tracing)", path, time.perf_counter() - t0)
            return fn
        except UNUSABLE_FILE as e:  # never break a run: warn, compile again, and the package is rewritten
            log.warning("FluxAccel: ignoring unusable warm-start package %s (%s: %s); compiling this shape",
                        path, type(e).__name__, e)
            return None

    def blocks_path(self, sig: str) -> Path:
        return self.dir / f"{self.key}-{sig}.blocks"

    def blocks_on_disk(self, sig: str) -> bool:
        """Whether a whole call of this signature has its per-block packages on disk: its
        index names them, and each is there."""
        try:
            names = json.loads(self.blocks_path(sig).read_text())["blocks"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return bool(names) and all(self.path(b).is_file() for b in names)

    def save_blocks(self, sig: str, blocks: list[str]) -> bool:
        """Write the index of a whole call's per-block packages (temporary name, then rename)."""
        path = self.blocks_path(sig)
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": self.key, "signature": sig, "blocks": sorted(blocks)}))
            os.replace(tmp, path)
            return True
        except OSError as e:
            log.warning("FluxAccel: could not save the block index %s (%s); a restart compiles this shape's blocks in "
                        "a separate process again", path, e)
            return False

    def save(self, sig: str, fn) -> bool:
        """Write the package (temporary name, then rename: workers may share the folder)."""
        path = self.path(sig)
        try:
            payload = torch_internals.serialize_aot(fn)
            meta = {"key": self.key, "signature": sig, "torch": torch.__version__, "sources": _source_digests(fn)}
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n" + payload)
            os.replace(tmp, path)
            log.info("FluxAccel: saved warm-start package %s (%d bytes)", path, len(payload))
            return True
        except UNWRITABLE as e:
            log.warning("FluxAccel: could not save the warm-start package %s (%s: %s); a restart traces this "
                        "shape again", path, type(e).__name__, e)
            return False



def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


class Packages:
    """The warm-start compiled calls of one compiled model, one per call signature: loaded from the package file, or
    AOT-compiled now and saved for the next process. `outcome` says per shape how its call came about ("loaded",
    "saved", or why there is no package); `load_seconds` how long loading took."""

    def __init__(self, store: WarmStart, options: dict):
        self.store, self.options = store, options
        self.calls: dict[str, Callable | None] = {}
        self.outcome: dict = {}
        self.load_seconds: dict = {}
        self.pending: dict[str, concurrent.futures.Future] = {}  # packages loading in the background (prefetch)
        self.signature_of: dict = {}  # outcome key (a shape, or a block kind at a shape) -> its package's signature

    def prefetch(self, limit: int, device: torch.device) -> str:
        """Start loading this model's packages on disk (the `limit` newest) in a background thread, so
        that the load overlaps what ComfyUI does before the first model call (moving the weights to the GPU). The
        first call of a signature then takes its package from there. Returns what was done, in words."""
        sigs = [s for s in self.store.signatures() if s not in self.calls][:limit]
        if not sigs:
            return "no warm-start package on disk for this model"
        load_opts = {k: self.options[k] for k in LOAD_OPTIONS if k in self.options}
        differs = torch_internals.inductor_config_differs(load_opts)
        if differs or isinstance(differs, Unavailable):  # what differs, or cannot tell
            why = f"warm-start packages load at the first model call: inductor's {differs} differ from this process's"
            log.info("FluxAccel: %s", why)
            return why
        # the modules a load and the sampler's compiling call both import, imported here first: Python's import of
        # one package from two threads at once can fail (KeyError in importlib)
        torch_internals.import_inductor()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fluxaccel-warm-start")
        device = torch.device(device)

        background = {k: self.options[k] for k in BACKGROUND_OPTIONS if k in self.options}

        def load(sig: str):
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                return self.store.load(sig, background or None)

        self.pending = {sig: pool.submit(load, sig) for sig in sigs}
        pool.shutdown(wait=False)
        log.info("FluxAccel: loading %d warm-start package(s) in the background", len(sigs))
        return f"loading {len(sigs)} warm-start package(s) in the background"

    def on_disk(self, sig: str) -> bool:
        """Whether this signature's package is loaded, loading, or on disk."""
        return sig in self.calls or sig in self.pending or self.store.path(sig).is_file()

    def get(self, key, call: Call, loading=None) -> Callable | None:
        """This call's compiled function (call.dm is passed as its first argument), or None: torch.compile runs it.
        loading: a context manager around a package's load (the compile watch's phase)."""
        try:
            sig = call.signature()
        except NotPackageable as e:
            self.settle()  # torch.compile traces this call: not while a package loads in the background
            if key not in self.outcome:
                self.outcome[key] = f"no package ({e})"
                log.warning("FluxAccel: %s has no warm-start package: %s; it compiles with torch.compile instead, "
                            "which a restarted ComfyUI traces again", key.describe(), e)
            return None
        self.signature_of[key] = sig
        if sig not in self.calls:
            self.calls[sig] = self._load_or_compile(key, sig, call, loading)
        return self.calls[sig]

    def blocks_of(self, shape) -> list[str] | None:
        """The signatures of the per-block packages a call at `shape` used, where every block
        kind's package was saved or loaded; None otherwise."""
        parts = [k for k in self.signature_of if getattr(k, "shape", None) == shape]
        if not parts or any(self.outcome.get(k) not in ("saved", "loaded") for k in parts):
            return None
        return [self.signature_of[k] for k in parts]

    def outcome_of(self, key) -> tuple[str | None, float | None]:
        """(how this shape's compiled call came about, seconds its packages took to load): its own outcome, or that of
        its per-block packages (one per block kind, keyed by an object whose .shape is key)."""
        if key in self.outcome:
            return self.outcome[key], self.load_seconds.get(key)
        parts = [(k, v) for k, v in self.outcome.items() if getattr(k, "shape", None) == key]
        if not parts:
            return None, None
        said = {v for _, v in parts}
        outcome = next(iter(said)) if len(said) == 1 else "; ".join(f"{k.describe()}: {v}" for k, v in parts)
        seconds = [self.load_seconds[k] for k, _ in parts if k in self.load_seconds]
        return outcome, (round(sum(seconds), 2) if seconds else None)

    def settle(self) -> None:
        """Wait for the background loads (their outcome is taken by the first call of their signature)."""
        for fut in list(self.pending.values()):
            with contextlib.suppress(Exception):
                fut.result()

    def _load_or_compile(self, key, sig: str, call: Call, loading) -> Callable | None:
        t0 = time.perf_counter()
        early = self.pending.pop(sig, None)
        with loading() if loading is not None else contextlib.nullcontext():
            # started by prefetch: wait for it unless it has not begun (then loaded here, as without prefetch)
            loaded = early.result() if early is not None and not early.cancel() else self.store.load(sig, self.options)
        if loaded is not None:
            counts["loaded"] += 1
            self.outcome[key], self.load_seconds[key] = "loaded", round(time.perf_counter() - t0, 2)
            return loaded
        breaks = torch_internals.graph_break_error()
        try:
            compiled = aot_compile(call, self.options)
        except Exception as e:  # noqa: BLE001 -- any failure to package: said, and torch.compile runs the call
            if isinstance(breaks, type) and isinstance(e, breaks):
                raise  # not one graph: the runner turns it into an error (runner.one_graph)
            self.outcome[key] = f"no package ({_first_line(e)})"
            log.warning("FluxAccel: %s cannot be compiled into a warm-start package (%s); it compiles with "
                        "torch.compile instead, which a restarted ComfyUI traces again", key.describe(),
                        _first_line(e))
            return None
        self.outcome[key] = "saved" if self.store.save(sig, compiled) else "compiled, not saved (see the log)"
        return compiled
