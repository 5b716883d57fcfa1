"""Whole-model torch.compile of FLUX with CUDA graphs, and the fixed-shape contract around it.

This file knows the compiled callable; compile_patch.py puts it into a ComfyUI ModelPatcher.
Recipe, in order (each step's why):
  1. quantize (optional, fp8_patch)  -- FP8 Linears are in the module tree before tracing, so they get fused
  2. compile the *whole* diffusion model, dynamic=False -- one graph per shape; per-block (regional) compile
     with CUDA graphs overwrites block outputs between replays. With block_regions the repeated FLUX blocks are
     nested compile regions inside that one graph (block_regions.py): each kind compiled once, reused 19/38 times
  3. capture CUDA graphs (inductor's cudagraph trees; with graph_capture "call" the blocks compiled on their own
     and each call captured whole, call_graphs.py, also under cudaMallocAsync) -- removes kernel-launch overhead
  4. warm up at every shape the workflow uses (Warmup node) -- compile/capture before the first real prompt
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

from .config import MODES, POLICIES, CompileConfig  # noqa: F401  (the compile config's home is config.py)
from .block_regions import for_config
from .call_graphs import CallGraphs
from .runner import Runner
from .shapes import ShapeKey, ShapePolicy, dtype_name, shape_key, without_references  # noqa: F401
from .options import attention_override, refuse_unsupported
from .stats import CompileStats
from .telemetry import Telemetry
from ..upstream import torch_internals

log = logging.getLogger("fluxaccel.compile")


class CompiledFlux(torch.nn.Module):
    """Stands in for BaseModel.diffusion_model during apply_model, in three parts with one job each: the shape policy
    (which shapes run compiled), the runner (the compiled call) and the telemetry (stats, progress, editor)."""

    def __init__(self, dm: torch.nn.Module, cfg: CompileConfig, device: torch.device, variant: str = "",
                 layout: str | None = None, scale: int = 8, references: bool = True, mod_table=None):
        super().__init__()
        # held outside _modules: the live diffusion model must not appear twice in the module tree
        object.__setattr__(self, "_dm", dm)
        self.cfg, self.device, self.scale = cfg, torch.device(device), scale  # scale: pixels per latent cell
        self.references = references  # whether the architecture reads reference latents (models/profiles.py)
        self.stats = CompileStats()
        self.policy = ShapePolicy(cfg.resolution_policy, cfg.max_shapes)
        self.cache, self.packages = self._persistence(dm, variant, layout)
        # graphs: inductor's (trees, whole-model compile), or FluxAccel's capture of each call (blocks on their own)
        self.regions = for_config(dm, cfg, self.device, self.packages if cfg.captured else None)
        self.runner = Runner(dm, cfg.inductor_options(self.device), cfg.cuda_graphs and not cfg.captured,
                             self.regions, None if cfg.captured else self.packages,
                             attention=attention_override(cfg.attention), whole=not cfg.captured,
                             call_graphs=CallGraphs(limit=2 * cfg.max_shapes)
                             if cfg.captured and self.device.type == "cuda" else None, mod_table=mod_table)
        self.telemetry = Telemetry(self)
        self.separate = self._separate(self.packages)
        self.here = False  # compiling_here(): Warmup and Benchmark compile in this process

    def _persistence(self, dm, variant: str, layout: str | None):
        """The kernel cache (kernel_cache.py) and the warm-start packages (warm_start.py), as the config asks."""
        if not self.cfg.persistent_cache:
            return None, None
        from .kernel_cache import KernelCache, cache_key
        from .warm_start import Packages, WarmStart, available

        cache = KernelCache(cache_key(dm, self.cfg, self.device, variant, layout))
        self.stats.cache_loaded = cache.load()
        usable, why = available() if self.cfg.warm_start else (False, "warm_start off in the compile config")
        if usable:
            packages = Packages(WarmStart(cache.key, cache.dir), self.cfg.inductor_options(self.device))
            # a restart: the saved packages load while ComfyUI moves the weights, not at the first model call (with
            # graph_capture "call" one package per block kind and shape)
            packages.prefetch(self.cfg.max_shapes * (2 if self.cfg.captured else 1), self.device)
            return cache, packages
        self.stats.warm_start_off = why
        if self.cfg.warm_start:
            self.stats.degrade("warm start", f"{why}; a restarted ComfyUI traces the model again")
            log.warning("FluxAccel: no warm-start packages: %s; a restarted ComfyUI traces the model again", why)
        return cache, None

    def _separate(self, packages):
        """The separate-process compiles (separate.py) where the config asks for them and packages carry them back."""
        if not self.cfg.separate_process:
            return None
        if packages is None:
            off = self.stats.warm_start_off or "the compile cache is off"
            why = f"it needs warm-start packages, and there are none here ({off})"
        else:
            from .separate import SeparateCompiles

            return SeparateCompiles(packages.store, self.cfg, self.device)
        self.stats.degrade("compile in a separate process", f"{why}; a new shape compiles in its first call")
        log.warning("FluxAccel: no compile in a separate process: %s; a new shape compiles in its first call", why)
        return None

    @contextlib.contextmanager
    def compiling_here(self):
        """Within: a shape not compiled yet compiles in its call, in this process, or waits for the separate process
        already compiling it (Warmup and Benchmark: they compile before the first prompt, and measure the compiled
        model)."""
        before, self.here = self.here, True
        try:
            yield self
        finally:
            self.here = before

    def __getattr__(self, name):
        # BaseModel reads attributes of its diffusion_model (dtype, ...) while we stand in for it
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_dm"), name)

    # the editor's callbacks (nodes/events.py), held by the telemetry
    on_compiled = property(lambda self: self.telemetry.on_compiled,
                           lambda self, fn: setattr(self.telemetry, "on_compiled", fn))
    on_progress = property(lambda self: self.telemetry.on_progress,
                           lambda self, fn: setattr(self.telemetry, "on_progress", fn))

    @property
    def graphs(self) -> bool:
        return self.cfg.cuda_graphs

    @property
    def graphs_active(self) -> bool:
        """CUDA graphs asked for and possible here (they are CUDA-only; on the CPU the option is ignored)."""
        return self.cfg.cuda_graphs and self.device.type == "cuda"

    @property
    def graphs_running(self) -> bool:
        """graphs_active, and none dropped for any shape: by inductor (at compile or past its re-record limit), or a
        capture of FluxAccel's that failed."""
        if not self.graphs_active:
            return False
        if self.runner.call_graphs is not None:
            return not self.runner.call_graphs.failures()
        return not self.stats.graph_skips and not self.stats.graphs_lost

    def derive(self) -> "CompiledFlux":
        """A CompiledFlux for a downstream node's output (Warmup): the same compiled callable, caches and block
        regions, with its own allowed shapes and stats (copies), so that what it registers leaves this one -- an
        upstream node's output, which ComfyUI treats as immutable -- as it was."""
        new = copy.copy(self)  # shallow: the runner (compiled callable, packages), model, caches, regions are shared
        new.stats = self.stats.copy()
        new.telemetry = Telemetry(new)
        new.telemetry.on_compiled, new.telemetry.on_progress = self.on_compiled, self.on_progress
        return new

    def register_shape(self, key: ShapeKey) -> None:
        """Allow a shape explicitly (the Warmup node), whatever the resolution policy; bounded by max_shapes."""
        if self.policy.register(key, self.stats.shapes):
            self.stats.shapes.append(key)

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):
        refuse_unsupported(control, transformer_options, kwargs, self.regions, self.cfg.attention)
        if not self.references:
            kwargs = without_references(kwargs)
        key = shape_key(x, context, kwargs, self.scale)
        decision = self.policy.decide(key, self.stats.shapes)
        if decision == "eager":  # eager_fallback for a shape that is not compiled: counted, and logged by the policy
            self.stats.eager_calls += 1
            return self._dm(x, timestep, context=context, transformer_options=transformer_options, **kwargs)
        if decision == "new":
            self.stats.shapes.append(key)
        if key in self.stats.compile_seconds:
            with self.telemetry.warm_call(key, x):
                out = self.runner(key, x, timestep, context, transformer_options, kwargs)
        elif self.separate is not None and self.separate.runs_uncompiled(self, key, x, timestep, context,
                                                                          transformer_options, kwargs):
            self.stats.eager_calls += 1  # uncompiled while a separate process compiles the shape: counted, shown
            self.stats.uncompiled_while_compiling += 1
            return self._dm(x, timestep, context=context, transformer_options=transformer_options, **kwargs)
        else:  # artifacts recorded for this model's kernel-cache file only; the CPU ISA list the options set: not kept
            recording = self.cache.recording() if self.cache is not None else contextlib.nullcontext()
            with self.telemetry.first_call(key, transformer_options, x) as watch, recording, \
                    torch_internals.vec_isa_list_kept():
                out = self.runner(key, x, timestep, context, transformer_options, kwargs, watch.loading_package)
            if self.cache is not None:
                self.cache.save()
            if self.separate is not None:  # graph_capture "call": the index of the shape's per-block packages
                self.separate.record(self, key, x, timestep, context, transformer_options, kwargs)
        self.telemetry.count_call(self.runner.paused)
        return out
