"""torch's dynamo and inductor internals FluxAccel reaches (see the package docstring).

torch has no public counter for what a compile did (graphs made, CUDA graphs skipped or recorded, phase timers), no
per-call recompile budget and no per-call inductor config: these are read or patched here, for the duration of
FluxAccel's own call only. Where torch offers a public API it is used instead (torch.compiler.save_cache_artifacts /
load_cache_artifacts when the per-compile artifact recording is gone).
"""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Callable

import torch

from . import Unavailable, say

UPSTREAM = "torch"


def _missing(name: str, detail: str = "") -> Unavailable:
    return Unavailable(UPSTREAM, str(torch.__version__), name, detail)


def _attr(path: str):
    """The object at a dotted path below torch (imported as needed), or an Unavailable naming it."""

    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):  # an attribute or an imported submodule: no import machinery (calls read this)
            obj = getattr(obj, part)
            continue
        try:
            if not isinstance(obj, ModuleType):
                raise ImportError
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return _missing(path)
    return obj


# -- compile options and budgets ------------------------------------------------------------------------------------
def mode_options(mode: str) -> dict | Unavailable:
    """The inductor options a torch.compile mode stands for (so CUDA graphs can be set on top of it)."""
    fn = _attr("torch._inductor.list_mode_options")
    if not callable(fn):
        return fn
    return dict(fn(mode, dynamic=False))


def dynamo_config_patch(**values):
    """dynamo's config patched for the body only; names this torch does not have are left out (and said)."""
    cfg = _attr("torch._dynamo.config")
    if isinstance(cfg, Unavailable):
        say(cfg, "dynamo's settings for FluxAccel's call are left as they are")
        return contextlib.nullcontext()
    have = {k: v for k, v in values.items() if hasattr(cfg, k)}
    return cfg.patch(**have) if have else contextlib.nullcontext()


def dynamo_config_value(name: str, default=None):
    cfg = _attr("torch._dynamo.config")
    return default if isinstance(cfg, Unavailable) else getattr(cfg, name, default)


def recompile_budget(limit: int):
    """Context: dynamo's recompile limits raised to at least `limit` for the body (they count per code object, and
    every FluxAccel model compiles the same Flux.forward)."""
    cfg = _attr("torch._dynamo.config")
    names = ("recompile_limit", "accumulated_recompile_limit")
    have = {} if isinstance(cfg, Unavailable) else {k: max(getattr(cfg, k), limit) for k in names if hasattr(cfg, k)}
    if not have:
        say(_missing("torch._dynamo.config.recompile_limit"),
            "dynamo's default recompile budget applies: past it a new shape runs uncompiled")
        return contextlib.nullcontext()
    return cfg.patch(**have)


def inductor_config_patch(options: dict | None):
    cfg = _attr("torch._inductor.config")
    if isinstance(cfg, Unavailable):
        say(cfg, "inductor options cannot be set while loading a warm-start package")
        return contextlib.nullcontext()
    return cfg.patch(options or {})


def inductor_config_differs(options: dict) -> dict | Unavailable:
    """The options (dotted names) whose value differs from inductor's config in this process now ({} if none)."""
    differs = {}
    for name, value in options.items():
        now = _attr(f"torch._inductor.config.{name}")
        if isinstance(now, Unavailable):
            return now
        if now != value:
            differs[name] = value
    return differs


_wider: dict[tuple, type] = {}  # (inductor's choices class, limits) -> its subclass with wider persistent reductions


def _with_wider_persistence(base: type, v, hints, inner: int, other: int) -> type:
    """A subclass of inductor's choices class `base` that makes a reduction persistent where `base` would loop over it:
    a row reduction (ReductionHint.INNER) of up to `inner` elements, one of hint DEFAULT of up to `other`. Column
    reductions (OUTER) and every other decision stay base's. v: inductor's virtualized V (the graph being lowered)."""
    key = (base, inner, other)
    if key not in _wider:
        limits = {hints.INNER: inner, hints.DEFAULT: other}

        def should_use_persistent_reduction(self, features, cooperative_reduction):
            if super(_wider[key], self).should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if cooperative_reduction or _attr("torch._inductor.config.triton.persistent_reductions") is not True:
                return False
            try:
                limit = limits.get(features.get_reduction_hint())
                if limit is None or getattr(features, "strict_sum_rblock", lambda: None)() is not None:
                    return False
                return bool(v.graph.sizevars.statically_known_leq(features.reduction_numel, limit))
            except (AttributeError, TypeError):  # a later inductor's features: its own decision stands
                return False

        _wider[key] = type(f"WiderPersistence{inner}x{other}", (base,), {
            "should_use_persistent_reduction": should_use_persistent_reduction,
            "uuid": lambda self: f"fluxaccel-persistent-{inner}-{other}"})
    return _wider[key]


@contextlib.contextmanager
def persistent_reductions(inner: int, other: int):
    """Context: graphs lowered in the body make a row reduction (over a contiguous last dimension) of up to `inner`
    elements, and one inductor hints DEFAULT of up to `other`, a persistent kernel -- the row read once and held in
    registers -- where inductor's own rule loops (above 1,024 and 64 elements); column reductions and everything else
    as inductor decides. Inductor's choices handler is thread-local and a compile lowers in the calling thread:
    nothing outside the body sees it."""
    v = _attr("torch._inductor.virtualized.V")
    hints = _attr("torch._inductor.runtime.hints.ReductionHint")
    consequence = "reductions compile as inductor decides (looped above 1,024 elements)"
    missing = next((got for got in (v, hints) if isinstance(got, Unavailable)), None)
    setter = getattr(v, "set_choices_handler", None)
    current = getattr(v, "choices", None)
    if missing is None and (setter is None or not hasattr(type(current), "should_use_persistent_reduction")
                            or not all(hasattr(hints, h) for h in ("INNER", "DEFAULT"))):
        missing = _missing("torch._inductor.virtualized.V.set_choices_handler / InductorChoices.should_use_persistent_"
                           "reduction / ReductionHint.INNER")
    if missing is not None:
        say(missing, consequence)
        yield
        return
    cls = _with_wider_persistence(type(current), v, hints, inner, other)
    handler = cls.__new__(cls)  # the thread's handler as it is (its state kept), with the one decision changed
    handler.__dict__.update(getattr(current, "__dict__", {}))
    with setter(handler), _cache_tag(handler.uuid()):
        yield


def _cache_tag(tag: str):
    """torch's compile caches keyed by `tag` too, for the body: kernels lowered with a changed inductor choice are not
    taken from (or stored as) the entries of the same graph lowered without it."""
    cfg = _attr("torch.compiler.config")
    if isinstance(cfg, Unavailable) or not hasattr(cfg, "cache_key_tag"):
        say(_missing("torch.compiler.config.cache_key_tag"), "inductor's cache may hand out kernels of the same graph "
            "compiled without FluxAccel's wider persistent row reductions (same results, looped row reductions)")
        return contextlib.nullcontext()
    now = cfg.cache_key_tag
    return cfg.patch(cache_key_tag=f"{now}|{tag}" if now else tag)


# -- what a compile did ---------------------------------------------------------------------------------------------
def compile_timers() -> dict | Unavailable:
    """dynamo's compile timers: name -> list of seconds (each phase's timer is recorded when the phase ends)."""
    return _attr("torch._dynamo.utils.compilation_time_metrics")


def is_compiled_module(obj) -> bool:
    """A module that torch.compile wrapped (OptimizedModule) or compiled in place (Module.compile())."""
    cls = _attr("torch._dynamo.eval_frame.OptimizedModule")
    if isinstance(cls, Unavailable):
        say(cls, "modules wrapped by torch.compile are not recognised (only those compiled in place)")
    elif isinstance(obj, cls):
        return True
    return bool(getattr(obj, "_compiled_call_impl", None))


# -- inductor's cache artifacts ---------------------------------------------------------------------------------------
def _artifact_manager():
    return _attr("torch.compiler._cache.CacheArtifactManager")


def per_compile_artifacts() -> bool | Unavailable:
    """Whether the artifacts of one compile can be recorded apart from the rest of the process."""
    m = _artifact_manager()
    if isinstance(m, Unavailable):
        return m
    for name in ("with_fresh_cache", "_new_cache_artifacts", "serialize", "deserialize", "populate_caches"):
        if not hasattr(m, name):
            return _missing(f"torch.compiler._cache.CacheArtifactManager.{name}")
    return True


@contextlib.contextmanager
def recording_artifacts(into: Callable[[dict], None]):
    """Around a compile: the cache artifacts it records are handed to `into` (kind -> artifacts) when it ends and
    kept out of the process-wide list. Where torch cannot record them apart, `into` gets nothing and the process-wide
    list keeps them (save_artifacts then falls back to torch's public save_cache_artifacts)."""
    if per_compile_artifacts() is not True:
        yield
        return
    m = _artifact_manager()
    with m.with_fresh_cache():
        try:
            yield
        finally:
            into(dict(m._new_cache_artifacts))


def save_artifacts(artifacts: dict) -> bytes | None:
    """Serialize artifacts recorded by recording_artifacts (or, without per-compile recording, everything this
    process recorded: torch.compiler.save_cache_artifacts)."""
    if per_compile_artifacts() is not True:
        res = torch.compiler.save_cache_artifacts()
        return res[0] if res else None
    m = _artifact_manager()
    with m.with_fresh_cache():
        for kind, items in artifacts.items():
            m._new_cache_artifacts[kind].extend(items)
        res = m.serialize()
    return res[0] if res else None


def load_artifacts(payload: bytes) -> tuple[dict, str]:
    """Hot-load serialized artifacts into inductor's caches: (kind -> artifacts for re-saving, torch's summary).
    Raises ValueError for a payload torch cannot read."""
    if per_compile_artifacts() is not True:
        info = torch.compiler.load_cache_artifacts(payload)
        if info is None:
            raise ValueError("its artifacts cannot be read")
        return {}, str(info)
    m = _artifact_manager()
    artifacts = m.deserialize(payload)
    if artifacts is None:
        raise ValueError("its artifacts cannot be read")
    info = m.populate_caches(artifacts)
    return dict(artifacts), str(info)


# -- inductor's C++ wrapper (captured calls under cudaMallocAsync) --------------------------------------------------
def cpp_compiler() -> str | Unavailable:
    """The host C++ compiler inductor's C++ wrapper builds with; "" where it finds none."""
    fn = _attr("torch._inductor.cpp_builder.get_cpp_compiler")
    if not callable(fn):
        return fn
    try:
        return str(fn() or "")
    except (RuntimeError, OSError, ValueError) as e:  # inductor raises when its compiler search finds nothing
        del e
        return ""


@contextlib.contextmanager
def vec_isa_list_kept():
    """Within: FluxAccel's compile or package load may run with inductor's `cpp.vec_isa_ok` set for its GPU code
    (config.py); inductor keeps the CPU vector-ISA list it computes then for the whole process (functools cache). Where
    that list was not computed before the body, it is dropped after it, so that a later compile of other code computes
    its own. Where torch lacks the list or its cache, the body runs as is (and that is said once)."""
    fn = _attr("torch._inductor.cpu_vec_isa.valid_vec_isa_list")
    info, clear = getattr(fn, "cache_info", None), getattr(fn, "cache_clear", None)
    if not (callable(info) and callable(clear)):
        say(fn if isinstance(fn, Unavailable) else _missing("torch._inductor.cpu_vec_isa.valid_vec_isa_list.cache_clear"),
            "the CPU vector-ISA list computed while FluxAccel compiles GPU code stays in inductor's cache")
        yield
        return
    empty = info().currsize == 0
    try:
        yield
    finally:
        if empty:
            clear()


# -- AOT-compiled functions (warm-start packages) ------------------------------------------------------------------
def aot_compile_available() -> bool | Unavailable:
    if not hasattr(torch.compiler, "load_compiled_function"):
        return _missing("torch.compiler.load_compiled_function", "torch 2.9 or newer")
    ser = _attr("torch._dynamo.aot_compile.AOTCompiledFunction.serialize")
    return ser if isinstance(ser, Unavailable) else True


def enable_aot_compile():
    """torch 2.9-2.11 read dynamo's enable_aot_compile when torch.compile wraps a function: on for the body only."""
    return dynamo_config_patch(enable_aot_compile=True)


def serialize_aot(fn) -> bytes:
    cls = _attr("torch._dynamo.aot_compile.AOTCompiledFunction")
    if isinstance(cls, Unavailable):
        raise RuntimeError(str(cls))
    return cls.serialize(fn).serialized_data


def graph_break_error() -> type | Unavailable:
    """The exception dynamo raises for a graph break under fullgraph=True (torch._dynamo.exc.Unsupported)."""
    return _attr("torch._dynamo.exc.Unsupported")


def graph_break_site(e: BaseException) -> str:
    """Where in the traced source a dynamo error happened ('file:line in function'), or '' where it does not say."""
    stack = getattr(e, "real_stack", None)
    if not stack:
        return ""
    f = stack[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


# -- a module tree over the same storage ----------------------------------------------------------------------------
_TABLES = ("_parameters", "_buffers", "_modules")  # nn.Module's own tables of its parameters, buffers, children


def module_shallow_copy(m: torch.nn.Module) -> torch.nn.Module | Unavailable:
    """A new module object of m's class holding m's parameters, buffers and children in tables of its own (adding,
    removing or replacing one on the copy leaves m as it was), with hook registries of its own too."""
    if not all(isinstance(vars(m).get(t), dict) for t in _TABLES):
        return _missing("nn.Module._parameters/_buffers/_modules", f"on a {type(m).__name__}")
    new = type(m).__new__(type(m))
    new.__dict__.update(vars(m))
    for k, v in vars(m).items():  # the tables and hook registries (_forward_hooks, ...): the copy's own
        if k in _TABLES or (k.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(v, dict)):
            new.__dict__[k] = type(v)(v)
    return new


def share_module_tree(root: torch.nn.Module, drop: tuple[str, ...] = ()) -> torch.nn.Module | Unavailable:
    """A copy of `root`'s module tree: new module objects (so moving, patching or casting the copy never touches the
    original's modules or parameters) whose parameters and buffers hold the original's tensors' storage. Instance
    attributes named in `drop` are left out (the class's defaults apply); attributes that point at modules of the
    tree point at their copies. torch has no public way to build a module without running its __init__ (which would
    allocate every weight): this fills nn.Module's own tables."""
    bare = next((m for m in root.modules() if not all(isinstance(vars(m).get(t), dict) for t in _TABLES)), None)
    if bare is not None:
        return _missing("nn.Module._parameters/_buffers/_modules", f"on a {type(bare).__name__}")
    copies: dict[int, torch.nn.Module] = {}

    def copy_one(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in copies:  # a module used twice stays one module
            return copies[id(m)]
        new = module_shallow_copy(m)
        for k in drop:
            new.__dict__.pop(k, None)
        for n, p in m._parameters.items():  # new Parameter objects over the same storage
            new._parameters[n] = None if p is None else torch.nn.Parameter(p.data, requires_grad=p.requires_grad)
        copies[id(m)] = new
        new.__dict__["_modules"] = type(m._modules)((n, None if c is None else copy_one(c))
                                                    for n, c in m._modules.items())
        return new

    out = copy_one(root)
    for new in copies.values():  # aliases: a plain attribute holding a module of the tree
        for k, v in list(vars(new).items()):
            if isinstance(v, torch.nn.Module) and id(v) in copies and k != "_modules":
                new.__dict__[k] = copies[id(v)]
    return out


def module_tensors(root: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `root`'s module tree (a tensor held twice is listed twice, None left out), read
    from nn.Module's own tables with one explicit walk: what a captured call checks before each replay, without
    parameters() + buffers() and their nested generators.
    Where a module has no such tables, the public walk."""
    params, buffers, children = _TABLES
    out: list = []
    stack = [root]
    while stack:
        m = stack.pop()
        if m is None:  # an emptied child slot
            continue
        d = vars(m)
        p, b, c = d.get(params), d.get(buffers), d.get(children)
        if not (isinstance(p, dict) and isinstance(b, dict) and isinstance(c, dict)):
            return [t for t in (*root.parameters(), *root.buffers()) if t is not None]
        out += p.values()
        out += b.values()
        stack += c.values()
    return [t for t in out if t is not None]


# -- page-locked host buffers ---------------------------------------------------------------------------------------
def pin_host(t: torch.Tensor) -> bool | Unavailable:
    """Page-lock a CPU tensor's memory (CUDA's cudaHostRegister, as ComfyUI pins its own buffers), so that copies
    from it to the GPU run at the bus's speed; False where CUDA refuses. unpin_host releases it."""
    fn = _attr("torch.cuda.cudart")
    try:
        register = fn().cudaHostRegister if callable(fn) else None
    except Exception as e:  # noqa: BLE001 -- no CUDA runtime in this build
        return _missing("torch.cuda.cudart().cudaHostRegister", f"{type(e).__name__}: {e}")
    if register is None:
        return fn if isinstance(fn, Unavailable) else _missing("torch.cuda.cudart().cudaHostRegister")
    return int(register(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0


def unpin_host(t: torch.Tensor) -> None:
    """Release what pin_host locked."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


INDUCTOR_MODULES = ("torch._inductor.choices", "torch._inductor.codecache", "torch._inductor.output_code",
                    "torch._inductor.compile_fx")


def import_inductor() -> list[str]:
    """Import inductor's modules that a warm-start package's load and a compile both need, in the calling thread;
    the names this torch does not have (nothing to do there)."""
    missing = []
    for name in INDUCTOR_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


# -- dynamic dimensions ---------------------------------------------------------------------------------------------
def mark_dynamic(t: torch.Tensor, dim: int) -> bool | Unavailable:
    """Tell torch.compile that `t`'s dimension `dim` varies between calls (torch._dynamo.mark_dynamic): one trace
    serves every size of it."""
    fn = _attr("torch._dynamo.mark_dynamic")
    if isinstance(fn, Unavailable):
        return fn
    fn(t, dim)
    return True


# -- how much dynamo compiled --------------------------------------------------------------------------------------
def compiled_graph_count() -> int | None:
    """The graphs dynamo has compiled in this process (torch._dynamo.utils.counters["stats"]["unique_graphs"]); None
    where this torch keeps no such counter."""
    counters = _attr("torch._dynamo.utils.counters")
    if isinstance(counters, Unavailable):
        say(counters, "the parallel workers' node text cannot say how many graphs they compiled")
        return None
    return int(counters["stats"]["unique_graphs"])
