"""Put a CompiledFlux into a ComfyUI ModelPatcher clone through a keyed APPLY_MODEL wrapper.

As ComfyUI's own set_torch_compile_wrapper does: the wrapper swaps BaseModel.diffusion_model for the compiled
callable for the duration of one apply_model call and restores it in `finally`; any previous wrapper under our
key is removed first. The loaded model and other branches are never compiled.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..models import swaps
from ..models.loaded import foreign_graph_compilers, require_compatible, resident
from ..quant.linear import takes_pair
from .config import CompileConfig
from . import mod_table, single_block
from .compiled import CompiledFlux
from .staging import staging_wrapper
from ..env import require_torch
from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, torch_internals
from ..models.flux import (latent_scale, on_load_callback_type, partial_load_guard, profile, require_flux,
                           require_fully_loaded)

log = logging.getLogger("fluxaccel.compile")

COMPILE_KEY = "fluxaccel.compile"
COMFY_COMPILE_KEY = comfy_internals.COMFY_COMPILE_KEY
NODE = "Compile + CUDA Graph (FluxAccel)"


def _apply_model_type() -> str:
    from comfy.patcher_extension import WrappersMP

    return WrappersMP.APPLY_MODEL


def regional_compiles(model) -> list[str]:
    """Per-block/regional compiles already on the model: wrappers or object patches compiling parts of it."""
    found = []
    for key, fns in model.wrappers.get(_apply_model_type(), {}).items():
        if key == COMFY_COMPILE_KEY:
            for fn in fns:
                keys = comfy_internals.compile_wrapper_keys(fn)
                if not keys:  # cannot tell what it compiles: treated as regional, and the message says so
                    keys = [f"? ({keys})"]
                if keys != ["diffusion_model"]:
                    found.append(f"ComfyUI torch.compile wrapper on {', '.join(keys)}")
    for key, obj in swaps.items(model):
        if torch_internals.is_compiled_module(obj):
            found.append(f"compiled object patch {key}")
    for name, mod in model.model.diffusion_model.named_modules():
        if name and torch_internals.is_compiled_module(mod):
            found.append(f"compiled submodule diffusion_model.{name}")
    return found


def cuda_graph_blockers(device: torch.device) -> list[str]:
    """Process settings under which inductor's CUDA graphs (cudagraph trees) cannot be used, with the launch flag that
    fixes each."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    out = []
    try:
        backend = torch.cuda.get_allocator_backend()
    except (AttributeError, RuntimeError):
        backend = "native"
    if backend == "cudaMallocAsync":
        out.append("ComfyUI runs PyTorch's cudaMallocAsync allocator (its default), which inductor's CUDA-graph "
                   "trees do not support; start ComfyUI with --disable-cuda-malloc to use them")
    return out


def call_capture_unavailable() -> str:
    """Why FluxAccel cannot capture whole compiled calls here (call_graphs.py, inductor's C++ wrapper); "" if it can."""
    cc = torch_internals.cpp_compiler()
    if isinstance(cc, Unavailable):
        return f"{cc}: the C++ wrapper's build cannot be checked"
    if not cc:
        return "no C++ compiler for inductor's C++ wrapper was found (install g++, or set CXX)"
    return ""


def resolve_capture(cfg: CompileConfig, device: torch.device) -> tuple[CompileConfig, str]:
    """(config, why not "call"): graph_capture "auto" made "call" where it can run -- a CUDA device, CUDA graphs on,
    block_regions on and a C++ compiler found -- and "inductor" elsewhere (the CPU, graphs off, block_regions off, or
    no C++ compiler: the reason is the second item then, '' in the other cases). Other values are kept."""
    if cfg.graph_capture != "auto":
        return cfg, ""
    if cfg.cuda_graphs and cfg.block_regions and torch.device(device).type == "cuda":
        why_not = call_capture_unavailable()
        if not why_not:
            return dataclasses.replace(cfg, graph_capture="call"), ""
        return dataclasses.replace(cfg, graph_capture="inductor"), f"graph_capture 'call' cannot run here: {why_not}"
    return dataclasses.replace(cfg, graph_capture="inductor"), ""


def _table_under(cfg: CompileConfig, model, dm, node: str) -> tuple[CompileConfig, str]:
    """(config, why the table is off): modulation_table "auto" made "on" where the model allows it and "off" (with
    the reason) elsewhere; "on" where it cannot run is refused, naming what to change."""
    if cfg.modulation_table == "off":
        return cfg, ""
    why = mod_table.why_not_here(model, dm)
    if not why:
        return dataclasses.replace(cfg, modulation_table="on"), ""
    if cfg.modulation_table == "on":
        raise FluxAccelError(f"{node}: modulation_table cannot run on this model: {why}. Set modulation_table to "
                             f"'auto' or 'off'.")
    log.info("FluxAccel: %s runs without the modulation table: %s", node, why)
    return dataclasses.replace(cfg, modulation_table="off"), f"{why}; each call computes its modulations"


def _graphs_under(cfg: CompileConfig, device: torch.device, node: str) -> tuple[CompileConfig, str]:
    """(config, why CUDA graphs are off or ""): graph_capture "call" where a C++ compiler is found (any allocator);
    inductor's graphs where its cudagraph trees can run; otherwise graphs off, said why and what to set. "auto" is
    resolved first (resolve_capture), which has checked "call" already where it chose it."""
    checked = cfg.graph_capture == "auto"
    cfg, no_call = resolve_capture(cfg, device)
    if not cfg.cuda_graphs or torch.device(device).type != "cuda":
        return cfg, ""
    if cfg.graph_capture == "call":
        why_not = "" if checked else call_capture_unavailable()
        if not why_not:
            return cfg, ""
        graphs_off = f"graph_capture 'call' cannot run here: {why_not}"
    else:
        blockers = cuda_graph_blockers(device)
        if not blockers:
            return cfg, ""
        graphs_off = "; ".join(blockers) + (f"; and {no_call}" if no_call else ", or set graph_capture to 'call'")
    log.warning("FluxAccel: %s compiles without CUDA graphs: %s", node, graphs_off)
    return dataclasses.replace(cfg, cuda_graphs=False), graphs_off


def _staging_record(stats):
    """(count, on_fail) for staging_wrapper: staged tensors counted in the stats; a failure said in the stats (node
    text, badge) and the log."""
    def count(n: int) -> None:
        stats.staged_tensors += n

    def on_fail(why: str) -> None:
        stats.degrade("stage_inputs", f"{why}; ComfyUI's own copy of the sampler's inputs runs (the host waits for the "
                                      f"GPU at every call)")
        log.warning("FluxAccel: stage_inputs is off from now on: %s; ComfyUI's own copy of the sampler's inputs runs",
                    why)
    return count, on_fail


def _install(clone, compiled: CompiledFlux):
    """Put `compiled` on `clone` (already a clone): our one keyed APPLY_MODEL wrapper, replacing any earlier one, and
    the CompiledFlux as the clone's COMPILE_KEY attachment (read by Warmup, Benchmark and the editor badge)."""
    wt = _apply_model_type()
    clone.remove_wrappers_with_key(wt, COMPILE_KEY)
    wrapper = comfy_internals.swap_in_wrapper({"diffusion_model": compiled})
    if compiled.cfg.stage_inputs:
        wrapper = staging_wrapper(wrapper, compiled.device, *_staging_record(compiled.stats))
    clone.add_wrapper_with_key(wt, COMPILE_KEY, wrapper)
    clone.set_attachments(COMPILE_KEY, compiled)
    return clone, compiled


def model_variant(model) -> str:
    """What the compiled graph depends on beyond the base module's parameters: FluxAccel's FP8 config and the
    modules other object patches swap in at load time (the persistent compile cache is keyed by it)."""
    from ..quant.patch import fp8_state
    from ..quant.static_scales import static_scales_state

    st = fp8_state(model)
    fp8 = st.config.key() if st else None
    if st and static_scales_state(model):  # the activations' quantization is another graph (the scales are inputs)
        fp8 = [*fp8, "static-activation-scales"]
    patched = swaps.items(model)  # by module key, as FluxAccel's block patches swap them (the cache keys stay)
    swapped = sorted(k for k, v in patched if isinstance(v, torch.nn.Module))
    tags = sorted({v.cache_tag for _, v in patched if isinstance(getattr(v, "cache_tag", None), str)})
    return repr((fp8, swapped, *([tags] if tags else [])))


def model_layout(model) -> str:
    """What the compiled graph's parameters look like, read from the patcher rather than the live module tree (which
    holds whichever clone's patches are applied at the moment): the architecture ComfyUI detected and the storage and
    compute dtypes. With _variant (FP8 config, swapped modules) it keys the persistent compile cache."""
    bm = model.model
    unet = getattr(getattr(bm, "model_config", None), "unet_config", None) or {}
    return repr((type(bm.diffusion_model).__name__, sorted((k, repr(v)) for k, v in unet.items()),
                 str(bm.get_dtype()), str(getattr(bm, "manual_cast_dtype", None))))


def _say_single_blocks_off(compiled: CompiledFlux, model, dm, node: str) -> None:
    """Where the config asks for FluxAccel's single-block forward (single_block.py) and Quantize FP8 fused the single
    blocks' MLP activation into linear2, but the forward cannot run: say why (the model's stats, the node's text, the
    log)."""
    blocks, cfg = getattr(dm, "single_blocks", None), compiled.cfg
    if not (cfg.block_regions and cfg.single_blocks == "fluxaccel" and blocks):
        return
    linear2 = swaps.get(model, "diffusion_model.single_blocks.0.linear2")
    if linear2 is None or not takes_pair(linear2, getattr(blocks[0], "hidden_size", -1)):
        return
    why = single_block.known(type(blocks[0]))
    if why:
        compiled.stats.degrade("single_blocks fluxaccel", f"{why}; ComfyUI's forward runs (linear2's concatenated "
                                                          f"input is written first)")
        log.warning("FluxAccel: %s runs ComfyUI's single-block forward: %s", node, why)


def _say_qk_bound_off(compiled: CompiledFlux, dm, node: str) -> None:
    """FP8 attention in block regions takes each block's Q/K scales from its QK-norm weights; a block where they cannot
    be read (as the Compile node gets the model) takes each call's absmax of Q and K instead (the same kind of scale,
    one more pass over Q and K): say how many and why (the model's stats, the node's text, the log)."""
    if compiled.cfg.attention != "fp8" or not compiled.cfg.block_regions:
        return
    from .fp8_attention import why_no_qk_bound

    blocks = [*getattr(dm, "double_blocks", ()), *getattr(dm, "single_blocks", ())]
    whys = [w for w in map(why_no_qk_bound, blocks) if w]
    if whys:
        why = f"{len(whys)} of {len(blocks)} blocks take each call's absmax of Q and K instead: {whys[0]}"
        compiled.stats.degrade("FP8 attention's Q/K scales from the QK-norm bound", why)
        log.warning("FluxAccel: %s: FP8 attention's Q/K scales: %s", node, why)


def apply_compile(model, cfg: CompileConfig, node: str = NODE):
    """Return a clone of `model` whose diffusion model runs compiled (and graph-captured) as one module."""
    require_flux(model, node)
    require_torch(node)
    model = resident(model, node)  # ComfyUI 0.33+ dynamic VRAM: a resident copy sharing its weights (models/resident.py)
    dm = require_flux(model, node)
    require_fully_loaded(model, node)
    require_compatible(model, dm, node)
    regional = regional_compiles(model) + foreign_graph_compilers(model)
    if regional and cfg.cuda_graphs:
        raise FluxAccelError(
            f"{node}: the model already carries a per-block (regional) compile ({'; '.join(regional)}). CUDA graphs "
            f"need the whole model compiled as one graph: remove the other compile node (e.g. TorchCompileModel with "
            f"block keys) or turn cuda_graphs off.")
    regions_off = ""
    if cfg.block_regions:
        from ..quant.patch import fp8_state

        fp8 = fp8_state(model)
        if fp8 and fp8.config.layout == "subclass" and cfg.captured:
            raise FluxAccelError(f"{node}: graph_capture 'call' compiles each kind of block on its own, which FP8 "
                                 f"weights in the 'subclass' layout cannot go through: set layout 'plain' on Quantize "
                                 f"FP8, or graph_capture 'inductor' here.")
        if fp8 and fp8.config.layout == "subclass":
            # torch has no rule for tensor-subclass weights (torchao's Float8Tensor) inside a nested compile region
            regions_off = ("FP8 weights in the 'subclass' layout cannot be used in torch's nested compile regions "
                           "(a longer first compile, same numerics); set layout 'plain' on Quantize FP8 to keep them")
            log.warning("FluxAccel: %s compiles without block_regions: %s", node, regions_off)
            cfg = dataclasses.replace(cfg, block_regions=False)
    device = torch.device(model.load_device)
    if cfg.attention == "fp8":
        from .fp8_attention import why_not

        why = why_not(device)
        if why:
            raise FluxAccelError(f"{node}: attention 'fp8' cannot run here: {why}. Set attention to 'cudnn'.")
    # graphs off, or not as asked, said: in the log (once per Compile node run), the model's stats, its label and the
    # editor badge
    cfg, graphs_off = _graphs_under(cfg, device, node)
    clone = model.clone()
    wt = _apply_model_type()
    if clone.get_wrappers(wt, COMFY_COMPILE_KEY):
        log.info("FluxAccel: replacing ComfyUI's whole-model torch.compile wrapper with FluxAccel's")
        clone.remove_wrappers_with_key(wt, COMFY_COMPILE_KEY)
        clone.model_options.pop("torch_compile_kwargs", None)
    # the modulation table's modules swapped in on the clone (mod_table.py): part of the compiled graph's variant
    cfg, table_off = _table_under(cfg, model, dm, node)
    table = mod_table.install(clone, model, dm, device) if cfg.modulation_table == "on" else None
    compiled = CompiledFlux(dm, cfg, device, variant=model_variant(clone), layout=model_layout(model),
                            scale=latent_scale(model), references=profile(model).references, mod_table=table)
    compiled.stats.graphs_off_reason = graphs_off
    for what, why in (("CUDA graphs", graphs_off), ("block_regions", regions_off), ("modulation_table", table_off)):
        if why:
            compiled.stats.degrade(what, why)
    _say_single_blocks_off(compiled, model, dm, node)
    _say_qk_bound_off(compiled, dm, node)
    clone.add_callback_with_key(on_load_callback_type(), COMPILE_KEY, partial_load_guard(node))
    return _install(clone, compiled)


def recompiled(model):
    """(model, its CompiledFlux): `model` (a clone its caller made, running other modules than the compiled model it
    came from, e.g. Warmup's static activation scales) with a CompiledFlux of its own: the same config, its own
    compiled callable, caches and stats, what ran below the config carried over. (model, None) if it is not compiled."""
    old = compiled_of(model)
    if old is None:
        return model, None
    compiled = CompiledFlux(old._dm, old.cfg, old.device, variant=model_variant(model),
                            layout=model_layout(model), scale=old.scale, references=old.references,
                            mod_table=old.runner.mod_table)
    compiled.stats.graphs_off_reason = old.stats.graphs_off_reason
    compiled.stats.degradations = [d for d in old.stats.degradations if d.kind == "off"]
    return _install(model, compiled)


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
    clone = model.clone()
    clone.remove_wrappers_with_key(_apply_model_type(), COMPILE_KEY)
    clone.remove_callbacks_with_key(on_load_callback_type(), COMPILE_KEY)
    clone.remove_attachments(COMPILE_KEY)
    # ComfyUI's modulations again (the table belongs to the compiled model)
    swaps.remove(clone, [k for k, v in swaps.items(clone) if isinstance(v, mod_table.TableModulation)])
    return clone
