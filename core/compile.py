"""Whole-model torch.compile of FLUX with CUDA graphs, and the fixed-shape contract around it.

This file knows the compiled callable; compile_patch.py puts it into a ComfyUI ModelPatcher.
Recipe, in order (each step's why):
  1. quantize (optional, fp8_patch)  -- FP8 Linears are in the module tree before tracing, so they get fused
  2. compile the *whole* diffusion model, dynamic=False -- one graph per shape; per-block (regional) compile
     with CUDA graphs overwrites block outputs between replays. With block_regions the repeated FLUX blocks are
     nested compile regions inside that one graph (block_regions.py): each kind compiled once, reused 19/38 times
  3. capture CUDA graphs (inductor's cudagraph trees) -- removes per-kernel launch overhead
  4. warm up at every shape the workflow uses (Warmup node) -- compile/capture before the first real prompt
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from .compile_progress import CompileWatch
from .errors import FluxAccelError
from .rope import torch_rope
from .upstream import Unavailable, comfy_internals, say, torch_internals

log = logging.getLogger("fluxaccel.compile")

MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs", "max-autotune")
POLICIES: tuple[str, ...] = ("strict", "recompile", "eager_fallback")


@dataclass(frozen=True)
class CompileConfig:
    cuda_graphs: bool = True
    mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    resolution_policy: Literal["strict", "recompile", "eager_fallback"] = "strict"
    max_shapes: int = 4
    persistent_cache: bool = True
    # with persistent_cache: each shape's trace saved as a warm-start package (warm_start.py), so a restarted ComfyUI
    # does not trace the model again; off: only inductor's artifacts are kept (compile_cache.py)
    warm_start: bool = True
    block_regions: bool = True  # H200 dev-1024-28: compile 73 -> 42 s, steady state +2-3 % (bench/NOTES.md)

    def __post_init__(self):
        if self.mode not in MODES:
            raise FluxAccelError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.resolution_policy not in POLICIES:
            raise FluxAccelError(f"resolution_policy must be one of {POLICIES}, got {self.resolution_policy!r}")
        if self.max_shapes < 1:
            raise FluxAccelError(f"max_shapes must be at least 1, got {self.max_shapes}")
        if self.block_regions:
            from .block_regions import available

            if not available():
                raise FluxAccelError(f"block_regions needs torch.compiler.nested_compile_region (torch 2.8 or newer); "
                                     f"this is torch {torch.__version__}. Turn block_regions off.")

    def summary(self) -> str:
        """The config in words (the Compile node's text)."""
        policy = {"strict": "only the first shape (another is an error)",
                  "recompile": f"up to {self.max_shapes} shapes, each compiled when first met",
                  "eager_fallback": "the first shape compiled, others run uncompiled (counted)"}[self.resolution_policy]
        return "; ".join([
            "whole model, compiled on first use" + (f" (mode {self.mode})" if self.mode != "default" else ""),
            "CUDA graphs " + ("on" if self.cuda_graphs else "off"),
            f"shapes: {policy}",
            "repeated blocks compiled once" if self.block_regions else "every block compiled",
            ("compile cache on" + (" with warm start" if self.warm_start else "")) if self.persistent_cache
            else "no compile cache (compiles again after a restart)"])

    def inductor_options(self, device: torch.device) -> dict:
        """Options passed to this torch.compile call only (no process-wide inductor/dynamo config changes).

        torch.compile takes either mode or options; a mode is expanded to its options so that CUDA graphs can be
        switched on or off on top of it. Graphs are CUDA-only: on other devices the option is left off.
        """
        opts = {}
        if self.mode != "default":
            opts = torch_internals.mode_options(self.mode)
            if not opts:
                raise FluxAccelError(f"mode {self.mode!r} cannot be expanded to inductor options here ({opts}); "
                                     f"set mode to 'default' on the Compile node.")
        opts["triton.cudagraphs"] = bool(self.cuda_graphs and torch.device(device).type == "cuda")
        # Round bf16 intermediates as eager does. Without it inductor keeps e.g. guidance * 1000 in float32 (3500)
        # where eager rounds it to bf16 (3504): FLUX's sinusoidal embeddings turn that into a different output
        # (35 % relative error on the tiny test model, 0.7 % with this option).
        opts["emulate_precision_casts"] = True
        return opts


@dataclass(frozen=True, order=True)
class ShapeKey:
    """What a compiled graph is specialised to: batch, latent H x W, text tokens, dtype."""

    batch: int
    height: int
    width: int
    text_len: int
    dtype: str

    def describe(self) -> str:
        return (f"batch {self.batch}, latent {self.height}x{self.width} ({self.width * 8}x{self.height * 8} px), "
                f"{self.text_len} text tokens, {self.dtype}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def shape_key(x: torch.Tensor, context: torch.Tensor | None) -> ShapeKey:
    text = int(context.shape[1]) if context is not None else 0
    return ShapeKey(int(x.shape[0]), int(x.shape[-2]), int(x.shape[-1]), text, dtype_name(x.dtype))


# dynamo's recompile budget is counted per code object: every CompiledFlux compiles the same Flux.forward, so all
# FluxAccel models of a process would share torch's default (8 entries), and a shape past it would run eager with no
# error. FluxAccel's calls run with a budget above anything max_shapes allows (torch._dynamo.config.patch: for the
# duration of our call only, restored after it).
RECOMPILE_LIMIT = 1024


def recompile_budget():
    return torch_internals.recompile_budget(RECOMPILE_LIMIT)


def cudagraph_skips() -> int | None:
    """Inductor's running count of graphs it compiled without CUDA graphs; None where torch does not say (said once)."""
    n = torch_internals.cudagraph_skips()
    if isinstance(n, Unavailable):
        say(n, "cannot tell whether inductor compiled a shape without CUDA graphs")
        return None
    return n


def graph_recordings(device: torch.device) -> tuple[int, int] | None:
    """(CUDA graphs recorded, re-recordings counted toward triton.cudagraph_unexpected_rerecord_limit) by inductor's
    cudagraph-trees manager of this thread and device so far; None where there is none yet or torch does not expose
    them (said once). A call during which the first number moves recorded a graph; past the limit a function runs
    without graphs (and cudagraph_skips moves once)."""
    rec = torch_internals.graph_recordings(device)
    if isinstance(rec, Unavailable):
        say(rec, "cannot tell whether CUDA graphs are recorded or re-recorded")
        return None
    return rec


# dynamo's timed phases of one compile (seconds summed over its sub-calls): where a first run's compile time goes
PHASES: tuple[str, ...] = ("bytecode_tracing", "create_aot_dispatcher_function", "GraphLowering.run",
                           "GraphLowering.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path",
                           "AOTAutogradCache.inductor_load", "build_guards")


def _phase_totals() -> dict[str, float]:
    timers = torch_internals.compile_timers()
    if isinstance(timers, Unavailable):
        say(timers, "a compile's time is not split by phase")
        return {}
    return {k: sum(timers.get(k, ())) for k in PHASES}


def _unsupported_options(transformer_options: dict) -> list[str]:
    """Per-block patches and diffusion-model wrappers that the compiled graph would silently drop."""
    found = []
    for group in ("patches", "patches_replace"):
        for name, value in (transformer_options.get(group) or {}).items():
            if value:
                found.append(f"{group}.{name}")
    from_wrappers = (transformer_options.get("wrappers") or {}).get("diffusion_model") or {}
    found += [f"diffusion_model wrapper '{k}'" for k, v in from_wrappers.items() if v]
    return found


# transformer_options that FLUX reads and the compiled call passes through (the graph guards on them: a changed
# value compiles again, a constant one costs nothing per call). The rest of what the sampler puts there (sigmas,
# uuids, cond_or_uncond, wrappers, ...) FLUX's forward does not read, and would only add guards.
PASSED_OPTIONS: tuple[str, ...] = ("rope_options", "optimized_attention_override")


def call_options(transformer_options: dict, regions=None) -> dict:
    """The transformer_options of one compiled call: block regions' table, the options FLUX reads, and the attention
    FluxAccel compiles with (core/attention.py) unless the workflow set its own override."""
    from .attention import OVERRIDE_KEY, sdpa_cudnn_first

    opts = regions.transformer_options() if regions is not None else {}
    opts.update({k: transformer_options[k] for k in PASSED_OPTIONS if k in transformer_options})
    opts.setdefault(OVERRIDE_KEY, sdpa_cudnn_first)
    return opts


@dataclass
class CompileStats:
    shapes: list[ShapeKey] = field(default_factory=list)
    compile_seconds: dict[ShapeKey, float] = field(default_factory=dict)
    calls: int = 0
    marks: int = 0
    eager_calls: int = 0
    cache_loaded: bool = False
    graph_skips: dict[ShapeKey, int] = field(default_factory=dict)  # inductor's cudagraph_skips at each compile
    graphs_off_reason: str = ""  # CUDA graphs asked for but not possible in this process (compile_patch.py)
    # warm calls: per shape, the calls during which inductor recorded CUDA graphs (1 expected: the first recording;
    # more are re-recordings, e.g. weights at new addresses after ComfyUI reloaded the model) and the reason graphs
    # stopped (inductor's re-record limit: it then runs the compiled graph without CUDA graphs)
    recording_calls: dict[ShapeKey, int] = field(default_factory=dict)
    graphs_lost: dict[ShapeKey, str] = field(default_factory=dict)
    compile_phases: dict[ShapeKey, dict[str, float]] = field(default_factory=dict)  # PHASES seconds per compile
    # per shape, how its compiled call came about (warm_start.py): "loaded" (a package: no tracing), "saved" (traced,
    # compiled and written for the next process), or why there is no package (it then re-traces after a restart)
    warm_start: dict[ShapeKey, str] = field(default_factory=dict)
    warm_start_off: str = ""  # why warm-start packages are not used at all here ("" when they are)
    # calls run with the Comfy model compiler's recording paused (ComfyUI 0.34+), and calls where it could not be told
    model_compiler_paused: int = 0
    model_compiler_unknown: int = 0
    attention_note: str = ""  # set when the compiled model runs SDPA in place of ComfyUI's attention (attention.py)
    # last warm calls: host seconds spent inside the call (graph replay is asynchronous, so on a GPU this is the
    # launch overhead: guards, input checks, replay) and (start, end) CUDA events around it (device time)
    host_s: deque = field(default_factory=lambda: deque(maxlen=256))
    device_events: deque = field(default_factory=lambda: deque(maxlen=256))

    def copy(self) -> "CompileStats":
        """The stats of a derived CompiledFlux (CompiledFlux.derive): its own allowed shapes, counters and timing
        windows; what the shared compiled callable has compiled (compile_seconds, phases, graph
        skips) stays shared, so a shape one of them compiled is not 'compiled' again by the other."""
        new = CompileStats(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        new.shapes = list(self.shapes)
        new.recording_calls, new.graphs_lost = dict(self.recording_calls), dict(self.graphs_lost)
        new.warm_start = dict(self.warm_start)
        new.host_s, new.device_events = deque(self.host_s, maxlen=256), deque(self.device_events, maxlen=256)
        return new

    def rerecords(self) -> int:
        return sum(max(0, n - 1) for n in self.recording_calls.values())

    def call_timings(self) -> dict:
        """Median host and device milliseconds per warm compiled call (synchronizes once to read the events)."""
        out = {}
        if self.host_s:
            out["model_call_host_ms_median"] = round(1000 * statistics.median(self.host_s), 3)
        if self.device_events:
            torch.cuda.synchronize()
            out["model_call_device_ms_median"] = round(statistics.median(a.elapsed_time(b) for a, b in self.device_events), 3)
        return out


class CompiledFlux(torch.nn.Module):
    """Stands in for BaseModel.diffusion_model during apply_model: checks the shape contract, marks a new
    CUDA-graph step, runs the compiled whole model, and returns an output the sampler may keep."""

    def __init__(self, dm: torch.nn.Module, cfg: CompileConfig, device: torch.device, variant: str = "",
                 layout: str | None = None):
        super().__init__()
        # held outside _modules: the live diffusion model must not appear twice in the module tree
        object.__setattr__(self, "_dm", dm)
        self.cfg = cfg
        self.device = torch.device(device)
        self.stats = CompileStats()
        self.cache = None
        self.regions = None
        if cfg.block_regions:
            from .block_regions import BlockRegions

            self.regions = BlockRegions(dm)
        self.on_compiled = None  # called with self after each new shape compiled (the node tells the editor)
        self.on_progress = None  # compile_progress.Report: (text, seconds) every second while a shape compiles
        self._watch = None  # the CompileWatch of the compile in progress (it says when a package is loading)
        self.warm = None  # warm-start packages (warm_start.py), with the persistent cache
        self._runners: dict[str, object] = {}  # call signature -> its package's compiled call; None: torch.compile
        if cfg.persistent_cache:
            from .compile_cache import CompileCache, cache_key
            from .warm_start import WarmStart, available

            self.cache = CompileCache(cache_key(dm, cfg, self.device, variant, layout))
            self.stats.cache_loaded = self.cache.load()
            usable, why = available() if cfg.warm_start else (False, "")
            if usable:
                self.warm = WarmStart(self.cache.key, self.cache.dir)
            elif cfg.warm_start:
                self.stats.warm_start_off = why
                log.warning("FluxAccel: no warm-start packages: %s; a restarted ComfyUI traces the model again", why)
            else:
                self.stats.warm_start_off = "warm_start off in the compile config"
        object.__setattr__(self, "_compiled", torch.compile(dm, backend="inductor", dynamic=False, fullgraph=False,
                                                            options=cfg.inductor_options(self.device)))

    def __getattr__(self, name):
        # BaseModel reads attributes of its diffusion_model (dtype, ...) while we stand in for it
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_dm"), name)

    @property
    def graphs(self) -> bool:
        return self.cfg.cuda_graphs

    @property
    def graphs_active(self) -> bool:
        """CUDA graphs asked for and possible here (they are CUDA-only; on the CPU the option is ignored)."""
        return self.cfg.cuda_graphs and self.device.type == "cuda"

    @property
    def graphs_running(self) -> bool:
        """graphs_active, and inductor has not dropped them for any shape (at compile or past its re-record limit)."""
        return self.graphs_active and not self.stats.graph_skips and not self.stats.graphs_lost

    def derive(self) -> "CompiledFlux":
        """A CompiledFlux for a downstream node's output (Warmup): the same compiled callable, compile cache and block
        regions, with its own allowed shapes and stats (copies), so that what it registers leaves this one -- an
        upstream node's output, which ComfyUI treats as immutable -- as it was."""
        import copy

        new = copy.copy(self)  # shallow: the compiled callable, model, cache and regions are shared on purpose
        new.stats = self.stats.copy()
        return new

    def register_shape(self, key: ShapeKey) -> None:
        """Allow a shape explicitly (the Warmup node), whatever the resolution policy; bounded by max_shapes."""
        if key in self.stats.shapes:
            return
        if len(self.stats.shapes) >= self.cfg.max_shapes:
            raise FluxAccelError(
                f"Warmup asks for more shapes than the Compile node's max_shapes ({self.cfg.max_shapes}); compiled: "
                f"{'; '.join(k.describe() for k in self.stats.shapes)}; asked: {key.describe()}. Raise max_shapes.")
        self.stats.shapes.append(key)

    def allow_shape(self, key: ShapeKey) -> bool:
        """Register a shape (Warmup, or the first call). False: run eagerly. Raises under strict/recompile."""
        if key in self.stats.shapes:
            return True
        if not self.stats.shapes:
            self.stats.shapes.append(key)
            return True
        compiled = "; ".join(k.describe() for k in self.stats.shapes)
        policy = self.cfg.resolution_policy
        if policy == "eager_fallback":
            log.warning("FluxAccel: %s is not a compiled shape (compiled: %s); running this call uncompiled "
                        "(resolution_policy eager_fallback)", key.describe(), compiled)
            return False
        if policy == "recompile" and len(self.stats.shapes) < self.cfg.max_shapes:
            log.info("FluxAccel: compiling a new shape %s (%d of at most %d)", key.describe(),
                     len(self.stats.shapes) + 1, self.cfg.max_shapes)
            self.stats.shapes.append(key)
            return True
        if policy == "recompile":
            raise FluxAccelError(
                f"The compiled FLUX model already holds {len(self.stats.shapes)} shapes (max_shapes "
                f"{self.cfg.max_shapes}): {compiled}. Received {key.describe()}. Raise max_shapes on the Compile "
                f"node, or use one of the compiled resolutions/batch sizes/prompt lengths.")
        raise FluxAccelError(
            f"This FLUX model is compiled for {compiled}, but received {key.describe()}. Use the compiled "
            f"resolution, batch size and prompt length (text tokens), or set resolution_policy to 'recompile' "
            f"(or add the shape in the Warmup node), or 'eager_fallback' on the Compile node.")

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):
        key = self._admit(x, context, control, transformer_options, kwargs)
        if key is None:  # eager_fallback for a shape that is not compiled: counted, and logged by allow_shape
            self.stats.eager_calls += 1
            return self._dm(x, timestep, context=context, transformer_options=transformer_options, **kwargs)
        if key not in self.stats.compile_seconds:
            return self._first_call(key, x, timestep, context, transformer_options, kwargs)
        return self._warm_call(key, x, timestep, context, transformer_options, kwargs)

    # -- shape policy: what may run compiled -------------------------------------------------------------------
    def _admit(self, x, context, control, transformer_options, kwargs) -> ShapeKey | None:
        """Refuse what the compiled graph cannot honour; the call's shape if it runs compiled, None if eager."""
        if control is not None:
            raise FluxAccelError("ControlNet inputs are not supported by the compiled FLUX model yet: bypass the "
                                 "Compile node (FluxAccel) when using ControlNet.")
        extra = _unsupported_options(transformer_options)
        if extra:
            raise FluxAccelError(
                f"The compiled FLUX model runs the whole model as one graph and would ignore per-block patches: "
                f"{', '.join(extra)}. Apply the node that adds them after removing Compile (FluxAccel), or bypass it.")
        if self.regions is not None and kwargs.get("ref_latents") is not None and \
                kwargs.get("ref_latents_method") == "index_timestep_zero":
            # ComfyUI 0.33 then modulates the reference tokens per block (modulation_dims), which the block
            # regions' replacement table does not pass: refuse rather than compute without it
            raise FluxAccelError("The compiled FLUX model's block_regions cannot run reference latents with "
                                 "ref_latents_method 'index_timestep_zero' (per-token modulation inside the blocks). "
                                 "Turn block_regions off on the Compile node (FluxAccel) for this workflow.")
        key = shape_key(x, context)
        return key if self.allow_shape(key) else None

    # -- runner: mark a graph step, call the compiled model, copy the output -----------------------------------
    def _run(self, key, x, timestep, context, transformer_options, kwargs, recording=contextlib.nullcontext()):
        if self.graphs:
            # A new CUDA-graph step per model call: outputs of the previous call may be overwritten from here on,
            # which is safe because we return a copy below.
            torch.compiler.cudagraph_mark_step_begin()
            self.stats.marks += 1
        opts = call_options(transformer_options, self.regions)
        # plain-torch RoPE, fused by inductor (ComfyUI 0.33's is an opaque kitchen op: rope.py)
        # outside the Comfy model compiler's memory plan (ComfyUI 0.34+), should one be recording on this thread
        with recording, recompile_budget(), torch_rope(), comfy_internals.outside_model_compiler() as paused:
            self._count_model_compiler(paused)
            run = self._runner(key, x, timestep, context, opts, kwargs)
            if run is None:  # no warm-start package for this call: dynamo traces it (again in each new process)
                out = self._compiled(x, timestep, context=context, transformer_options=opts, **kwargs)
            else:
                out = run(self._dm, x, timestep, context=context, transformer_options=opts, **kwargs)
        if self.graphs:
            out = out.clone()  # the sampler keeps outputs across steps; graph-owned memory is reused on replay
        self.stats.calls += 1
        return out

    def _count_model_compiler(self, paused) -> None:
        if paused is True:
            self.stats.model_compiler_paused += 1
        elif paused is not False:
            self.stats.model_compiler_unknown += 1
            say(paused, "cannot keep the compiled model outside the Comfy model compiler's memory plan; start "
                        "ComfyUI with --disable-comfy-compiler if a run fails")

    # -- warm start: the compiled call of this signature from its package, or traced and saved to one -----------
    def _runner(self, key: ShapeKey, x, timestep, context, opts, kwargs):
        """The warm-start compiled call for these inputs (loaded, or compiled and saved now); None: torch.compile."""
        if self.warm is None:
            return None
        from .warm_start import NotPackageable, signature

        try:
            sig = signature((x, timestep), {"context": context, **kwargs,
                                            "options": {k: opts[k] for k in PASSED_OPTIONS if k in opts}})
        except NotPackageable as e:
            if key not in self.stats.warm_start:
                self.stats.warm_start[key] = f"no package ({e})"
                log.warning("FluxAccel: %s has no warm-start package: %s; it compiles with torch.compile instead, "
                            "which a restarted ComfyUI traces again", key.describe(), e)
            return None
        if sig not in self._runners:
            self._runners[sig] = self._new_runner(key, sig, x, timestep, context, opts, kwargs)
        return self._runners[sig]

    def _new_runner(self, key: ShapeKey, sig: str, x, timestep, context, opts, kwargs):
        from .warm_start import aot_compile

        st = self.stats
        t0 = time.perf_counter()
        with self._watch.loading_package() if self._watch is not None else contextlib.nullcontext():
            run = self.warm.load(sig, self.cfg.inductor_options(self.device))
        if run is not None:
            st.warm_start[key] = "loaded"
            st.compile_phases.setdefault(key, {})["warm_start_load"] = round(time.perf_counter() - t0, 2)
            return run
        try:
            run = aot_compile(self._dm, self.cfg.inductor_options(self.device), (x, timestep),
                              dict(context=context, transformer_options=opts, **kwargs))
        except Exception as e:  # e.g. a graph break (a package needs one whole graph): said, then traced as before
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            st.warm_start[key] = f"no package ({reason})"
            log.warning("FluxAccel: %s cannot be compiled into a warm-start package (%s); it compiles with "
                        "torch.compile instead, which a restarted ComfyUI traces again", key.describe(), reason)
            return None
        st.warm_start[key] = "saved" if self.warm.save(sig, run) else "compiled, not saved (see the log)"
        return run

    # -- telemetry: compile facts of a first call, timings and graph health of warm ones -----------------------
    def _first_call(self, key: ShapeKey, x, timestep, context, transformer_options, kwargs):
        st = self.stats
        self._say_attention(transformer_options)
        t0 = time.perf_counter()
        skips_before, phases_before = cudagraph_skips(), _phase_totals()
        # the compile artifacts of this call are recorded for this model's cache file only (compile_cache.py)
        recording = self.cache.recording() if self.cache is not None else contextlib.nullcontext()
        with CompileWatch(self.on_progress, key.describe()) as self._watch:
            try:
                out = self._run(key, x, timestep, context, transformer_options, kwargs, recording)
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
            finally:
                self._watch = None
        st.compile_seconds[key] = time.perf_counter() - t0
        st.compile_phases[key] = {**st.compile_phases.get(key, {}), **{
            k: round(v - phases_before.get(k, 0), 2) for k, v in _phase_totals().items() if v - phases_before.get(k, 0) > 0}}
        if st.warm_start.get(key) == "loaded":
            log.info("FluxAccel: loaded %s from its warm-start package in %.1f s (nothing compiled)", key.describe(),
                     st.compile_seconds[key])
        else:
            log.info("FluxAccel: compiled %s in %.1f s", key.describe(), st.compile_seconds[key])
        skips_after = cudagraph_skips()
        skipped = skips_after - skips_before if skips_after is not None and skips_before is not None else 0
        if skipped and self.graphs_active:
            # inductor fell back to running (part of) the graph without CUDA graphs: correct, but slower
            st.graph_skips[key] = skipped
            log.warning("FluxAccel: inductor skipped CUDA graphs %d time(s) while compiling %s; this shape runs "
                        "compiled without (some) graphs. The reason: start ComfyUI with "
                        "TORCH_LOGS=perf_hints.", skipped, key.describe())
        if self.cache is not None:
            self.cache.save()
        if self.on_compiled is not None:
            self.on_compiled(self)
        return out

    def _say_attention(self, transformer_options) -> None:
        """Log once when the compiled model runs PyTorch SDPA in place of ComfyUI's untraceable attention."""
        from .attention import OVERRIDE_KEY, UNTRACEABLE, comfy_attention_name

        name = comfy_attention_name()
        if name in UNTRACEABLE and OVERRIDE_KEY not in transformer_options and not self.stats.attention_note:
            self.stats.attention_note = (
                f"ComfyUI runs {name} here, which reads free memory inside the model and cannot be compiled; the "
                f"compiled model uses PyTorch SDPA instead (what --use-pytorch-cross-attention selects)")
            log.info("FluxAccel: %s", self.stats.attention_note)

    def _warm_call(self, key: ShapeKey, x, timestep, context, transformer_options, kwargs):
        st = self.stats
        events = None
        if x.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        watch = self.graphs_active
        skips_before = cudagraph_skips() if watch else 0
        rec_before = graph_recordings(self.device) if watch else None
        t0 = time.perf_counter()
        out = self._run(key, x, timestep, context, transformer_options, kwargs)
        st.host_s.append(time.perf_counter() - t0)
        if events is not None:
            events[1].record()
            st.device_events.append(events)
        if watch:
            self._watch_graphs(key, skips_before, rec_before)
        return out

    def _watch_graphs(self, key: ShapeKey, skips_before: int, rec_before: tuple[int, int] | None) -> None:
        """After a warm call with CUDA graphs: count the calls that (re-)recorded graphs, warn as inductor's re-record
        limit nears, and mark the shape's graphs lost (stats, label, badge, log) once inductor stopped using them."""
        st = self.stats
        rec_after = graph_recordings(self.device)
        if rec_before is not None and rec_after is not None and rec_after[0] > rec_before[0]:
            st.recording_calls[key] = st.recording_calls.get(key, 0) + 1
            n = st.recording_calls[key] - 1
            limit = torch_internals.cudagraph_rerecord_limit()
            if n and (n == 1 or n % 16 == 0):
                log.warning("FluxAccel: CUDA graphs of %s re-recorded (%d time(s); inductor counts %d re-recording(s) "
                            "toward triton.cudagraph_unexpected_rerecord_limit = %d, past which it runs without "
                            "graphs): the model's weights moved, e.g. ComfyUI unloaded and reloaded it.",
                            key.describe(), n, rec_after[1], limit)
        if rec_after is None and self.graphs_running and st.calls >= 3:
            # cudagraph trees record on a shape's second or third call; none at all means the graph runs without
            # them (e.g. a loaded warm-start package wrapped without graphs): say so rather than claim '+graphs'
            st.graphs_lost[key] = ("no CUDA graph was recorded for this shape (inductor's cudagraph trees never ran): "
                                   "it runs compiled without graphs")
            log.warning("FluxAccel: %s: %s", key.describe(), st.graphs_lost[key])
            if self.on_compiled is not None:
                self.on_compiled(self)
        skips_after = cudagraph_skips() if skips_before is not None else None
        if skips_after is not None and skips_after > skips_before and key not in st.graphs_lost:
            st.graphs_lost[key] = (
                "inductor stopped using CUDA graphs for this shape after "
                f"{st.recording_calls.get(key, 1) - 1} re-recording(s) (its triton.cudagraph_unexpected_rerecord_limit"
                "; TORCH_LOGS=perf_hints says why): it runs compiled without graphs. Restart ComfyUI, or keep the "
                "model loaded (fewer /free or model switches), to get graphs back")
            log.warning("FluxAccel: %s: %s", key.describe(), st.graphs_lost[key])
            if self.on_compiled is not None:
                self.on_compiled(self)
