"""ComfyUI internals FluxAccel reaches (see the package docstring): each looked up when called, never assumed.

The Comfy model compiler (ComfyUI 0.34 and newer, comfy/model_prefetch.py): comfy-aimdo's malloc graph -- a memory
plan recorded on a model's first step and replayed after it -- with core's own per-block CUDA graphs inside it. It is
entered by the models that call it (MiniMax, some text encoders in 0.38) on dynamic-VRAM weights; FLUX's forward does
not call it in the sources available, and FluxAccel's compiled clone runs on resident (non-dynamic) weights, so core
queues no prefetch for it. Should a recording be active on the thread anyway (a future ComfyUI or another node that
wraps the sampler), FluxAccel's compiled call runs with it paused (`outside_model_compiler`), so inductor's buffers
and CUDA graphs never enter core's memory plan; other models and branches keep the compiler.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from pathlib import Path

import torch

from . import Unavailable, say

UPSTREAM = "ComfyUI"


def module(name: str):
    """ComfyUI's module `name`, imported when first asked (ImportError where this ComfyUI has none). Every ComfyUI
    module FluxAccel reads is reached through here, when used: the separate compile sets ComfyUI's launch flags
    before ComfyUI's modules read them on import, and tools/clear_cache.py runs without ComfyUI."""
    found = sys.modules.get(name)  # (dynamo traces this lookup, not importlib: rope.py's calls run inside a trace)
    return found if found is not None else importlib.import_module(name)


def comfyui_version() -> str:
    try:
        return str(module("comfyui_version").__version__)
    except (ImportError, AttributeError):
        return "(version unknown)"


def _missing(name: str, detail: str = "") -> Unavailable:
    return Unavailable(UPSTREAM, comfyui_version(), name, detail)


def _prefetch():
    """comfy.model_prefetch, or None on a ComfyUI without it (no per-block graphs, no model compiler)."""
    try:
        return module("comfy.model_prefetch")
    except ImportError:
        return None


# -- core's per-block CUDA graphs ---------------------------------------------------------------------------------
def core_graph_modules(dm: torch.nn.Module) -> list[str]:
    """Names of dm's modules that core's per-block CUDA graphs captured (a module's `_comfy_graph`, in 0.33 and 0.38)
    or warmed for capture (GRAPH_WARMED_MODULES; 0.33 also kept GRAPH_MODULES). Empty where ComfyUI has none."""
    prefetch = _prefetch()
    if prefetch is None:
        return []
    held: set[int] = set()
    registries = [n for n in ("GRAPH_MODULES", "GRAPH_WARMED_MODULES") if hasattr(prefetch, n)]
    for n in registries:
        try:
            held |= set(map(id, getattr(prefetch, n)))
        except TypeError:
            pass
    if not registries:
        say(_missing("comfy.model_prefetch.GRAPH_WARMED_MODULES"),
            "modules that core warmed for per-block CUDA graphs cannot be seen; only captured ones are checked")
    return [f"diffusion_model.{name}" for name, mod in dm.named_modules()
            if id(mod) in held or getattr(mod, "_comfy_graph", None) is not None]


# -- the Comfy model compiler (malloc graph) ----------------------------------------------------------------------
def model_compiler_present(prefetch=None) -> bool:
    """Whether this ComfyUI has the Comfy model compiler at all (0.34+: comfy.model_prefetch.malloc_graph_*)."""
    prefetch = prefetch or _prefetch()
    return prefetch is not None and any(hasattr(prefetch, n) for n in
                                        ("malloc_graph_begin", "malloc_graph_enabled", "MALLOC_GRAPHS"))


def model_compiler_recording() -> bool | Unavailable:
    """Whether the Comfy model compiler is recording a memory plan on this thread now."""
    prefetch = _prefetch()
    if not model_compiler_present(prefetch):
        return False
    graphs = getattr(prefetch, "MALLOC_GRAPHS", None)
    if not isinstance(graphs, dict):
        return _missing("comfy.model_prefetch.MALLOC_GRAPHS", "a per-thread dict of malloc graphs in 0.38")
    graph = graphs.get(threading.get_ident())
    return bool(graph is not None and getattr(graph, "_comfy_active", False))


@contextlib.contextmanager
def outside_model_compiler():
    """Run the body with the Comfy model compiler's recording paused on this thread (if one is active).

    Yields what was done: True (a recording was active and is paused for the body), False (none active, or a ComfyUI
    without the compiler) or an Unavailable (this ComfyUI has the compiler but FluxAccel cannot tell whether it
    records, or cannot pause it: the body runs as it is and the caller says so)."""
    recording = model_compiler_recording()
    if recording is False:
        yield False
        return
    prefetch = _prefetch()
    pause = getattr(prefetch, "pause_malloc_graph", None)
    if not callable(pause):
        yield _missing("comfy.model_prefetch.pause_malloc_graph", "added in 0.38")
        return
    # recording is True, or an Unavailable (cannot tell): pausing is harmless when it does not record (it checks itself)
    with pause(sync=False):
        yield recording


# -- FLUX's RoPE and checkpoint-quantized weights -------------------------------------------------------------------
def flux_math():
    return module("comfy.ldm.flux.math")


def flux_plain_rope1():
    """FLUX's plain-torch RoPE formula (`comfy.ldm.flux.math._apply_rope1`), None on a ComfyUI whose RoPE is plain
    torch already (no comfy-kitchen RoPE), an Unavailable where RoPE goes through comfy-kitchen but the plain formula
    is not where FluxAccel looks."""
    fm = flux_math()
    fn = getattr(fm, "_apply_rope1", None)
    if callable(fn):
        return fn
    kitchen = getattr(getattr(fm, "comfy", None), "quant_ops", None)
    if kitchen is not None and hasattr(getattr(kitchen, "ck", None), "apply_rope"):
        return _missing("comfy.ldm.flux.math._apply_rope1", "FLUX's RoPE goes through comfy-kitchen's custom op")
    return None


@contextlib.contextmanager
def flux_apply_rope_as(fn):
    """`comfy.ldm.flux.math.apply_rope` is `fn` for the body, restored in `finally`."""
    fm = flux_math()
    orig = fm.apply_rope
    fm.apply_rope = fn
    try:
        yield
    finally:
        fm.apply_rope = orig


def quantized_tensor_class():
    """ComfyUI's QuantizedTensor (0.33: comfy-kitchen's weight subclass of scaled-FP8 and other mixed-precision
    checkpoints), or None on hosts without it."""
    try:
        cls = module("comfy.quant_ops").QuantizedTensor
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, torch.Tensor) else None


def checkpoint_qdata(w) -> torch.Tensor | Unavailable:
    """The stored data of a ComfyUI QuantizedTensor weight (comfy-kitchen's keeps it in `_qdata`)."""
    q = getattr(w, "_qdata", None)
    if isinstance(q, torch.Tensor):
        return q
    return _missing("QuantizedTensor._qdata", f"a {type(w).__name__} weight")


def rms_norm_weight(norm) -> torch.Tensor | Unavailable:
    """The weight a FLUX QK-norm's RMSNorm multiplies by: comfy.ops' RMSNorm keeps it in `weight`."""
    w = getattr(norm, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    return _missing("RMSNorm.weight", f"a {type(norm).__name__} QK-norm")


# -- ComfyUI's own torch.compile wrapper ----------------------------------------------------------------------------
COMFY_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY


def swap_in_wrapper(modules: dict):
    """An APPLY_MODEL wrapper that sets BaseModel attributes (e.g. diffusion_model) to `modules` for one call and
    restores them in `finally`: ComfyUI's own apply_torch_compile_factory, or the same few lines where it is missing."""
    try:
        return module("comfy_api.torch_helpers.torch_compile").apply_torch_compile_factory(modules)
    except (ImportError, AttributeError) as e:
        say(_missing("comfy_api.torch_helpers.torch_compile.apply_torch_compile_factory", str(e)),
            "FluxAccel swaps the compiled model in with its own copy of that wrapper")

    utils = module("comfy.utils")

    def apply_swapped(executor, *args, **kwargs):
        base, originals = executor.class_obj, {}
        try:
            for key, value in modules.items():
                originals[key] = utils.get_attr(base, key)
                utils.set_attr(base, key, value)
            return executor(*args, **kwargs)
        finally:
            for key, value in originals.items():
                utils.set_attr(base, key, value)

    return apply_swapped


# -- Cancel --------------------------------------------------------------------------------------------------------
def interrupt_requested() -> bool | Unavailable:
    """Whether the user pressed Cancel (ComfyUI's processing_interrupted: /interrupt sets it, the executor clears it)."""
    fn = getattr(module("comfy.model_management"), "processing_interrupted", None)
    return bool(fn()) if callable(fn) else _missing("comfy.model_management.processing_interrupted")


def interrupt_exception() -> type:
    """The exception that ends a prompt as cancelled (ComfyUI's InterruptProcessingException), where it is."""
    cls = getattr(module("comfy.model_management"), "InterruptProcessingException", None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls
    say(_missing("comfy.model_management.InterruptProcessingException"),
        "a cancelled compile ends its prompt with KeyboardInterrupt, which ComfyUI reports as an error")
    return KeyboardInterrupt


# -- diffusion-model wrappers (EasyCache and other nodes' WrappersMP.DIFFUSION_MODEL) ---------------------------------
def diffusion_model_wrappers(transformer_options: dict) -> list | Unavailable:
    """The DIFFUSION_MODEL wrappers this call's transformer_options carry (ComfyUI's get_all_wrappers), in the order
    ComfyUI runs them; [] where there are none."""
    try:
        ext = module("comfy.patcher_extension")
        return list(ext.get_all_wrappers(ext.WrappersMP.DIFFUSION_MODEL, transformer_options))
    except (ImportError, AttributeError, TypeError) as e:
        return _missing("comfy.patcher_extension.get_all_wrappers / WrappersMP.DIFFUSION_MODEL", str(e))


def without_diffusion_model_wrappers(transformer_options: dict) -> dict:
    """A copy of transformer_options whose wrappers hold no DIFFUSION_MODEL ones (the caller runs them itself)."""
    wrappers = transformer_options.get("wrappers") or {}
    kind = getattr(getattr(module("comfy.patcher_extension"), "WrappersMP", None), "DIFFUSION_MODEL",
                   "diffusion_model")
    return {**transformer_options, "wrappers": {k: v for k, v in wrappers.items() if k != kind}}


def run_wrapped(fn, class_obj, wrappers: list, args: tuple, kwargs: dict):
    """fn(*args, **kwargs) inside `wrappers` as ComfyUI runs a model's wrappers (WrapperExecutor, class_obj: the
    model they wrap)."""
    executor = module("comfy.patcher_extension").WrapperExecutor.new_class_executor(fn, class_obj, wrappers)
    return executor.execute(*args, **kwargs)


# -- dynamic VRAM: the resident copy FluxAccel works on ---------------------------------------------------------------
# What ModelPatcher.__init__ (re)creates on a BaseModel when missing (plus ModelPatcherDynamic's dynamic_* records):
# a resident copy starts without them.
PATCHER_MODEL_STATE = ("model_loaded_weight_memory", "lowvram_patch_counter", "model_lowvram",
                       "current_weight_patches_uuid", "model_offload_buffer_memory")
# What ModelPatcherDynamic.load leaves on the modules it streams (comfy-aimdo's slot and pins, per-call cast state):
# the copy's modules start without them, so the classes' defaults of a plain load apply.
DYNAMIC_MODULE_STATE = ("_v", "_v_signature", "_pin_state", "seed_key", "comfy_cast_weights", "weight_function",
                        "bias_function", "weight_lowvram_function", "bias_lowvram_function")


def patcher_model_state(base) -> list[str]:
    return [k for k in vars(base) if k in PATCHER_MODEL_STATE or k.startswith("dynamic_")]


_NO_ATTR = object()


def weight_patches_uuid(base):
    """Which clone's weight patches are applied to the BaseModel's weights now (ModelPatcher sets
    current_weight_patches_uuid when it patches them, None when it restores them)."""
    uuid = getattr(base, "current_weight_patches_uuid", _NO_ATTR)
    return _missing("BaseModel.current_weight_patches_uuid") if uuid is _NO_ATTR else uuid


def kept_delegate(model):
    """The resident model a dynamic patcher keeps for its non-dynamic delegate (ModelPatcherDynamic
    .non_dynamic_delegate_model, 0.33): None while none is built, an Unavailable where this ComfyUI keeps it elsewhere."""
    kept = getattr(model, "non_dynamic_delegate_model", _NO_ATTR)
    if kept is _NO_ATTR:
        return _missing("ModelPatcherDynamic.non_dynamic_delegate_model")
    return kept


def delegate_override(model, base) -> tuple | Unavailable:
    """`base` (a BaseModel) as a dynamic patcher's delegate model: (base, empty patch backups of the shapes its
    get_clone_model_override gives), what ModelPatcher.clone(model_override=) takes. One such value serves every
    dynamic clone of a model: their delegates then share the model and its backups, as clones do."""
    override = getattr(model, "get_clone_model_override", None)
    if not callable(override):
        return _missing("ModelPatcher.get_clone_model_override")
    return base, tuple(type(b)() for b in override()[1])


def keep_delegate(model, override: tuple) -> bool | Unavailable:
    """Make `override` (delegate_override's) the dynamic patcher's kept delegate model, so get_non_dynamic_delegate()
    clones it instead of reloading the file."""
    if isinstance(kept_delegate(model), Unavailable):
        return kept_delegate(model)
    model.non_dynamic_delegate_model = override
    return True


def unload_model_and_clones(model) -> bool | Unavailable:
    """ComfyUI's unload of one model and its clones (comfy.model_management.unload_model_and_clones, 0.33): their
    weights go back to where the file put them."""
    fn = getattr(module("comfy.model_management"), "unload_model_and_clones", None)
    if not callable(fn):
        return _missing("comfy.model_management.unload_model_and_clones")
    fn(model)
    return True


# -- a weight with its patches, as ComfyUI computes it ----------------------------------------------------------------
def patched_weight(patches: list, key: str, weight: torch.Tensor, device) -> torch.Tensor | Unavailable:
    """`weight` (the stored weight at `key`) with these weight patches (LoRA, ...), on `device`, as
    ModelPatcher.patch_weight_to_device computes it for a plain op: cast to ComfyUI's LoRA compute dtype for the
    device, comfy.lora.calculate_weight, then ComfyUI's stochastic rounding back to the weight's dtype with the key's
    seed. Bit-identical to ComfyUI's (tests/core/upstream: against the real patch_weight_to_device)."""
    try:
        mm, lora, fl, utils = (module(n) for n in ("comfy.model_management", "comfy.lora", "comfy.float",
                                                   "comfy.utils"))
        temp = mm.cast_to_device(weight, device, mm.lora_compute_dtype(device), copy=True)
        out = lora.calculate_weight(patches, temp, key)
        return fl.stochastic_rounding(out, weight.dtype, seed=utils.string_to_seed(key))
    except (ImportError, AttributeError) as e:
        return _missing("comfy.lora.calculate_weight / comfy.float.stochastic_rounding / "
                        "comfy.model_management.lora_compute_dtype", str(e))


def hooked_weight(hooks: list, key: str, weight: torch.Tensor, stored: torch.Tensor, device) -> torch.Tensor | Unavailable:
    """`weight` (the key's weight with the clone's patches) with a hook LoRA's patches on top, on `device`, as
    ModelPatcher.patch_hook_weight_to_device computes it for a plain op: float32, comfy.lora.calculate_weight with the
    stored weight as the original (for 'model_as_lora' patches), then ComfyUI's stochastic rounding back to the
    weight's dtype with the key's seed."""
    try:
        mm, lora, fl, utils = (module(n) for n in ("comfy.model_management", "comfy.lora", "comfy.float",
                                                   "comfy.utils"))
        temp = mm.cast_to_device(weight, device, torch.float32, copy=True)
        out = lora.calculate_weight(hooks, temp, key, original_weights={key: [(stored, lambda a, **kw: a)]})
        return fl.stochastic_rounding(out, weight.dtype, seed=utils.string_to_seed(key))
    except (ImportError, AttributeError, TypeError) as e:
        return _missing("comfy.lora.calculate_weight(original_weights=) / comfy.float.stochastic_rounding", str(e))


def hooks_cached(patcher) -> bool | Unavailable:
    """Whether ComfyUI caches this patcher's hook weights per hook group (its hook_mode MaxSpeed, 0.33's default)."""
    try:
        return patcher.hook_mode == module("comfy.hooks").EnumHookMode.MaxSpeed
    except (ImportError, AttributeError) as e:
        return _missing("comfy.hooks.EnumHookMode / ModelPatcher.hook_mode", str(e))


# -- where a model's weights came from --------------------------------------------------------------------------------
def _patcher_init(model):
    init = getattr(model, "cached_patcher_init", _NO_ATTR)
    return _missing("ModelPatcher.cached_patcher_init") if init is _NO_ATTR else init


def source_file(model):
    """The weights file ComfyUI's loader read this model from (the path its cached_patcher_init reloads: UNETLoader's
    load_diffusion_model, CheckpointLoaderSimple's load_checkpoint_guess_config), None where none is registered."""
    init = _patcher_init(model)
    if isinstance(init, Unavailable):
        return init
    if not init:
        return None
    args = init[1] if len(init) > 1 and isinstance(init[1], (tuple, list)) else ()
    path = args[0] if args and isinstance(args[0], str) else None
    return Path(path) if path and os.path.isfile(path) else None


def load_options(model) -> dict[str, str]:
    """The model_options the loader was given (dtype, custom operations, ...), as text for a cache key."""
    init = _patcher_init(model)
    args = init[1] if init and not isinstance(init, Unavailable) and len(init) > 1 else ()
    opts = next((a for a in args if isinstance(a, dict)), {})
    return {str(k): str(v) for k, v in sorted(opts.items(), key=lambda kv: str(kv[0]))}


# -- building a model for its shapes ----------------------------------------------------------------------------------
def eager_init_ops():
    """ComfyUI's disable_weight_init op classes with every weight allocated at construction. Under comfy-aimdo (0.33,
    dynamic VRAM) its Linear and Embedding defer their weights to the state-dict load unless a subclass brings its own
    loader (`_load_from_state_dict`), so a model built to read its parameter shapes would have none."""
    base = module("comfy.ops").disable_weight_init

    class Linear(base.Linear):
        _load_from_state_dict = torch.nn.Linear._load_from_state_dict

    class Embedding(base.Embedding):
        _load_from_state_dict = torch.nn.Embedding._load_from_state_dict

    return type("EagerInitOps", (base,), {"Linear": Linear, "Embedding": Embedding})


# -- ComfyUI's own bounds --------------------------------------------------------------------------------------------
MAX_RESOLUTION_0_33 = 16384  # nodes.MAX_RESOLUTION in ComfyUI 0.33


def max_resolution() -> int:
    """The largest width or height ComfyUI's own latent nodes take (nodes.MAX_RESOLUTION, read where ComfyUI's nodes
    module is loaded; 0.33's value elsewhere)."""
    mod = sys.modules.get("nodes")
    value = getattr(mod, "MAX_RESOLUTION", None)
    return value if isinstance(value, int) and value > 0 else MAX_RESOLUTION_0_33


# -- launch flags -----------------------------------------------------------------------------------------------------
def launch_args() -> dict | Unavailable:
    """ComfyUI's launch flags as this process parsed them (comfy.cli_args.args), for a process FluxAccel starts."""
    try:
        return dict(vars(module("comfy.cli_args").args))
    except (ImportError, AttributeError, TypeError):
        return _missing("comfy.cli_args.args")


def set_launch_args(values: dict) -> bool | Unavailable:
    """Give this process ComfyUI's launch flags of another (before ComfyUI's modules read them)."""
    try:
        vars(module("comfy.cli_args").args).update(values)
        return True
    except (ImportError, AttributeError, TypeError):
        return _missing("comfy.cli_args.args")
