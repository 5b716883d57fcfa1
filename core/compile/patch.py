"""Put a CompiledFlux into a ComfyUI ModelPatcher clone through a keyed APPLY_MODEL wrapper.

As ComfyUI's own set_torch_compile_wrapper does: the wrapper swaps BaseModel.diffusion_model for the compiled
callable for the duration of one apply_model call and restores it in `finally`; any previous wrapper under our
key is removed first. The loaded model and other branches are never compiled.
"""
from __future__ import annotations

import logging

import torch

from ..env import require_torch
from ..errors import FluxAccelError
from ..models import swaps
from ..models.flux import FluxModel
from ..quant.linear import takes_pair
from ..upstream import Unavailable, comfy_internals, torch_internals
from . import mod_table, single_block
from .compiled import CompiledFlux, Setup
from .config import CompileConfig
from .keys import cache_key
from .staging import staging_wrapper

log = logging.getLogger("fluxaccel.compile")

COMPILE_KEY = "fluxaccel.compile"
COMFY_COMPILE_KEY = comfy_internals.COMFY_COMPILE_KEY
NODE = "Compile + CUDA Graph (FluxAccel)"


def _apply_model_type() -> str:
    from comfy.patcher_extension import WrappersMP

    return WrappersMP.APPLY_MODEL


def compiled_parts(model) -> list[str]:
    """Parts of the model another node compiled as modules of their own (object patches, submodules): FluxAccel's
    compiled block bodies would call them inside their own graph."""
    found = [f"compiled object patch {key}" for key, obj in swaps.items(model) if torch_internals.is_compiled_module(obj)]
    return found + [f"compiled submodule diffusion_model.{name}"
                    for name, mod in model.model.diffusion_model.named_modules()
                    if name and torch_internals.is_compiled_module(mod)]


def capture_unavailable(device: torch.device) -> str:
    """Why FluxAccel cannot capture model calls into CUDA graphs here ('' where it can): graphs need a CUDA device,
    and the compiled blocks' C++ wrapper (which runs under any CUDA allocator) a C++ compiler."""
    kind = torch.device(device).type
    if kind != "cuda":
        return f"this model runs on {'the CPU' if kind == 'cpu' else kind}; CUDA graphs need a CUDA GPU"
    cc = torch_internals.cpp_compiler()
    if isinstance(cc, Unavailable):
        return f"{cc}: the C++ wrapper's build cannot be checked"
    if not cc:
        return "no C++ compiler for inductor's C++ wrapper was found (install g++, or set CXX)"
    return ""


def _replace_comfy_compile(clone) -> None:
    """ComfyUI's own torch.compile wrapper (TorchCompileModel, whole model or per block) is replaced by FluxAccel's
    compile, which compiles the blocks itself: removed from the clone, said in the log."""
    wt = _apply_model_type()
    if clone.get_wrappers(wt, COMFY_COMPILE_KEY):
        log.info("FluxAccel: replacing ComfyUI's torch.compile wrapper (TorchCompileModel) with FluxAccel's compile")
        clone.remove_wrappers_with_key(wt, COMFY_COMPILE_KEY)
        clone.model_options.pop("torch_compile_kwargs", None)


def _staging_record(stats):
    """(count, on_fail) for staging_wrapper: staged tensors counted in the stats; a failure said in the stats (node
    text, badge) and the log."""
    def count(n: int) -> None:
        stats.staged_tensors += n

    def on_fail(why: str) -> None:
        stats.degrade("the sampler's inputs copied without waiting", f"{why}; ComfyUI's own copy runs (the host waits "
                                                                     f"for the GPU at every call)")
        log.warning("FluxAccel: pinned-memory copies of the sampler's inputs are off from now on: %s; ComfyUI's own "
                    "copy runs", why)
    return count, on_fail


def _install(clone, compiled: CompiledFlux):
    """Put `compiled` on `clone` (already a clone): our one keyed APPLY_MODEL wrapper, replacing any earlier one, and
    the CompiledFlux as the clone's COMPILE_KEY attachment (read by Warmup, Benchmark and the editor badge). On a GPU
    the wrapper first copies the sampler's CPU inputs there through pinned memory (staging.py)."""
    wt = _apply_model_type()
    clone.remove_wrappers_with_key(wt, COMPILE_KEY)
    wrapper = comfy_internals.swap_in_wrapper({"diffusion_model": compiled})
    if compiled.device.type == "cuda":
        wrapper = staging_wrapper(wrapper, compiled.device, *_staging_record(compiled.stats))
    clone.add_wrapper_with_key(wt, COMPILE_KEY, wrapper)
    clone.set_attachments(COMPILE_KEY, compiled)
    return clone, compiled


def _modulation_table(clone, flux: FluxModel, compiled_stats_degrade, device) -> object:
    """The modulation table on the clone where the model allows it (mod_table.py); where a FLUX.1 model does not,
    why is said (an architecture without per-block modulations has nothing to say)."""
    why = mod_table.why_not_here(flux.model, flux.dm)
    if not why:
        return mod_table.install(clone, flux.model, flux.dm, device)
    if mod_table.modulations(flux.dm):
        compiled_stats_degrade("modulation table", f"{why}; each call computes its modulations")
        log.info("FluxAccel: %s runs without the modulation table: %s", flux.node, why)
    return None


def _say_single_blocks_off(compiled: CompiledFlux, flux: FluxModel) -> None:
    """Where Quantize FP8 fused the single blocks' MLP activation into linear2 but FluxAccel's single-block forward
    (single_block.py) cannot run on this ComfyUI: say why (the model's stats, the node's text, the log)."""
    blocks = getattr(flux.dm, "single_blocks", None)
    if not blocks:
        return
    linear2 = swaps.get(flux.model, "diffusion_model.single_blocks.0.linear2")
    if linear2 is None or not takes_pair(linear2, getattr(blocks[0], "hidden_size", -1)):
        return
    why = single_block.known(type(blocks[0]))
    if why:
        compiled.stats.degrade("single blocks' fused input", f"{why}; ComfyUI's forward runs (linear2's concatenated "
                                                             f"input is written first)")
        log.warning("FluxAccel: %s runs ComfyUI's single-block forward: %s", flux.node, why)


def _say_qk_bound_off(compiled: CompiledFlux, dm) -> None:
    """FP8 attention takes each block's Q/K scales from its QK-norm weights; a block where they cannot be read takes
    each call's absmax of Q and K instead (one more pass over Q and K): say how many and why."""
    if compiled.cfg.attention != "fp8":
        return
    from .fp8_attention import why_no_qk_bound

    blocks = [*getattr(dm, "double_blocks", ()), *getattr(dm, "single_blocks", ())]
    whys = [w for w in map(why_no_qk_bound, blocks) if w]
    if whys:
        why = f"{len(whys)} of {len(blocks)} blocks take each call's absmax of Q and K instead: {whys[0]}"
        compiled.stats.degrade("FP8 attention's Q/K scales from the QK-norm bound", why)
        log.warning("FluxAccel: %s: FP8 attention's Q/K scales: %s", NODE, why)


def _refuse_other_compiles(flux: FluxModel) -> None:
    other = compiled_parts(flux.model) + flux.foreign_graphs
    if other:
        raise FluxAccelError(
            f"{flux.node}: parts of this model are already compiled or captured by another node ({'; '.join(other)}). "
            f"FluxAccel compiles each FLUX block itself and captures the whole model call, which cannot run another "
            f"node's compiled or captured blocks inside it: remove the other node, or load the model again for "
            f"FluxAccel.")


def apply_compile(model, cfg: CompileConfig, node: str = NODE):
    """Return (a clone of `model` whose diffusion model runs its blocks compiled and each call captured, the
    CompiledFlux); the input model is unchanged."""
    require_torch(node)
    flux = FluxModel.of(model, node)  # the resident model, checked: what FluxAccel can accelerate
    _refuse_other_compiles(flux)
    device = torch.device(flux.model.load_device)
    if cfg.attention == "fp8":
        from .fp8_attention import why_not

        why = why_not(device)
        if why:
            raise FluxAccelError(f"{node}: attention 'fp8' cannot run here: {why}. Set attention to 'cudnn'.")
    clone = flux.model.clone()
    _replace_comfy_compile(clone)
    degraded = []
    table = _modulation_table(clone, flux, lambda what, why: degraded.append((what, why)), device)
    capture = capture_unavailable(device)
    key = cache_key(clone, cfg, device, cfg.inductor_options(capture=not capture))
    compiled = CompiledFlux(flux.dm, cfg, Setup(device, key, capture, flux.scale, flux.references, table))
    if capture and device.type == "cuda":  # on a GPU graphs were expected: said as running below what it could
        compiled.stats.degrade("CUDA graphs", capture)
        log.warning("FluxAccel: %s runs without CUDA graphs: %s", node, capture)
    for what, why in degraded:
        compiled.stats.degrade(what, why)
    _say_single_blocks_off(compiled, flux)
    _say_qk_bound_off(compiled, flux.dm)
    clone.add_callback_with_key(flux.on_load_type, COMPILE_KEY, flux.partial_load_guard)
    return _install(clone, compiled)


def compiled_of(model) -> CompiledFlux | None:
    """The CompiledFlux Compile (or Warmup) put on this model, if any: its COMPILE_KEY attachment, while our wrapper
    is on the model (a clone that dropped the wrapper runs uncompiled, whatever it still carries)."""
    if not model.get_wrappers(_apply_model_type(), COMPILE_KEY):
        return None
    return model.get_attachment(COMPILE_KEY)


def with_own_shapes(model):
    """(clone, its CompiledFlux): a clone of a compiled model whose CompiledFlux is derived from the input's (own
    allowed shapes and stats), for a node that registers shapes (Warmup); (model, None) if it is not compiled."""
    compiled = compiled_of(model)
    if compiled is None:
        return model, None
    return _install(model.clone(), compiled.derive())


def remove_compile(model):
    """A clone running the uncompiled model (the Benchmark's default baseline)."""
    if compiled_of(model) is None:
        return model
    from ..models.flux import on_load_callback_type

    clone = model.clone()
    clone.remove_wrappers_with_key(_apply_model_type(), COMPILE_KEY)
    clone.remove_callbacks_with_key(on_load_callback_type(), COMPILE_KEY)
    clone.remove_attachments(COMPILE_KEY)
    # ComfyUI's modulations again (the table belongs to the compiled model)
    swaps.remove(clone, [k for k, v in swaps.items(clone) if isinstance(v, mod_table.TableModulation)])
    return clone
