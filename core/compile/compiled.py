"""The compiled FLUX model that stands in for BaseModel.diffusion_model, and the fixed-shape contract around it.

This file knows the compiled call; patch.py puts it into a ComfyUI ModelPatcher. The recipe, in order:
  1. quantize (optional, quant/patch.py) -- FP8 Linears are in the module tree before tracing, so they get fused
  2. compile each kind of FLUX block once, at fixed shapes (blocks.py): the double and the single block bodies,
     traced once and called for every block of their kind; the model around them runs as ComfyUI's code
  3. capture each model call whole into a CUDA graph (call_graphs.py) on a GPU where inductor's C++ wrapper can be
     built -- removes the launch overhead of the blocks and of the code around them, under any CUDA allocator
  4. warm up at every shape the workflow uses (Warmup node) -- compile and capture before the first real prompt
"""
from __future__ import annotations

import contextlib
import dataclasses
import copy
import logging
from dataclasses import dataclass

import torch

from . import persistence
from ..budget import call_bytes, require_room
from ..models.flux import token_px
from .blocks import BlockTable
from .call_graphs import CallGraphs
from .config import NODE, CompileConfig
from .options import attention_override, refuse_unsupported
from .runner import ModelCall, Runner
from .wrappers import outer, run_around
from .shapes import ShapeKey, ShapePolicy, shape_key, without_references
from .stats import CompileStats
from .telemetry import Telemetry
from ..upstream import comfy_internals, torch_internals

log = logging.getLogger("fluxaccel.compile")


@dataclass(frozen=True)
class Setup:
    """What a CompiledFlux is built for besides its config, found out by patch.apply_compile: the device, the inductor
    options of its compiles (config.inductor_options), the key of its files (keys.cache_key), why calls are not
    captured into CUDA graphs ('' where they are), pixels per latent cell, whether the architecture reads reference
    latents, its modulation table (or None) and what runs below what FluxAccel could do here ((what, why) pairs, for
    the stats)."""

    device: torch.device
    options: dict
    cache_key: str
    capture_off: str = ""
    scale: int = 8
    references: bool = True
    mod_table: object = None
    degraded: tuple = ()


class CompiledFlux(torch.nn.Module):
    """Stands in for BaseModel.diffusion_model during apply_model, in three parts with one job each: the shape policy
    (which shapes run compiled), the runner (the compiled call) and the telemetry (stats, progress, editor)."""

    def __init__(self, dm: torch.nn.Module, cfg: CompileConfig, setup: Setup):
        super().__init__()
        # held outside _modules: the live diffusion model must not appear twice in the module tree
        object.__setattr__(self, "_dm", dm)
        self.cfg, self.setup, self.device = cfg, setup, torch.device(setup.device)
        self.scale, self.references, self.options = setup.scale, setup.references, setup.options
        self.stats = CompileStats()
        for what, why in setup.degraded:
            self.stats.degrade(what, why)
        self.policy = ShapePolicy(cfg.resolution_policy, cfg.max_shapes)
        kept = persistence.open_for(cfg, setup, self.stats)
        self.cache, self.packages, self.separate = kept.cache, kept.packages, kept.separate
        self.runner = Runner(dm, BlockTable(dm, self.options, self.packages, cfg.dynamic_tokens),
                             attention=attention_override(cfg.attention),
                             call_graphs=None if setup.capture_off else CallGraphs(limit=2 * cfg.max_shapes),
                             mod_table=setup.mod_table)
        self.telemetry = Telemetry(self)
        self.here = False  # compiling_here(): Warmup and Benchmark compile in this process

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
    def graphs_running(self) -> bool:
        """Whether model calls are captured into CUDA graphs here, and no shape has lost them (a failed capture)."""
        graphs = self.runner.call_graphs
        return graphs is not None and not graphs.failures()

    def derive(self) -> "CompiledFlux":
        """A CompiledFlux for a downstream node's output (Warmup): the same compiled blocks, caches and captures, with
        its own allowed shapes and stats (copies), so that what it registers leaves this one -- an upstream node's
        output, which ComfyUI treats as immutable -- as it was."""
        new = copy.copy(self)  # shallow: the runner (compiled blocks, packages, graphs), model and caches are shared
        new.stats = self.stats.copy()
        new.telemetry = Telemetry(new)
        new.telemetry.on_compiled, new.telemetry.on_progress = self.on_compiled, self.on_progress
        return new

    def again(self) -> "CompiledFlux":
        """derive() for another clone of the same model, config and FP8 Linears (patch.apply_compile): its calls
        counted from zero."""
        new = self.derive()
        new.stats = self.stats.for_another_clone()
        new.telemetry = Telemetry(new)
        return new

    def register_shape(self, key: ShapeKey) -> None:
        """Allow a shape explicitly (the Warmup node), whatever the resolution policy; bounded by max_shapes."""
        if self.policy.register(key, self.stats.shapes):
            self.stats.shapes.append(key)

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):
        wrappers = outer(transformer_options)
        named = dict(x=x, timestep=timestep, context=context, control=control, **kwargs)
        if not wrappers:
            return self._call(ModelCall.of(named, transformer_options))
        inner = comfy_internals.without_diffusion_model_wrappers(transformer_options)

        def compiled_call(got: dict):  # the wrappers' innermost function: the compiled call of what they pass on
            options = got.pop("transformer_options", inner)
            return self._call(ModelCall.of(got, options))

        return run_around(compiled_call, self._dm, wrappers, {**named, "transformer_options": inner})

    def _call(self, call: ModelCall):
        refuse_unsupported(call.transformer_options, call.kwargs, self.cfg.attention)
        if not self.references:
            call = dataclasses.replace(call, kwargs=without_references(call.kwargs))
        key = shape_key(call.x, call.context, call.kwargs, self.scale)
        decision = self.policy.decide(key, self.stats.shapes)
        if decision == "eager":  # eager_fallback for a shape that is not compiled: counted, and logged by the policy
            self.stats.eager_calls += 1
            return call.run(self._dm)
        if decision == "new":  # compile buffers and a CUDA graph pool of this size: only where the call fits
            require_room(NODE, f"a model call at {key.describe()}", call_bytes(
                self._dm, key.tokens(token_px(self._dm, self.scale)), key.batch, call.x.element_size(), call.x.device),
                call.x.device)
            self.stats.shapes.append(key)
        if key in self.stats.compile_seconds:
            with self.telemetry.warm_call(call.x):
                out = self.runner(key, call)
        elif self.separate is not None and self.separate.runs_uncompiled(self, key, call):
            self.stats.eager_calls += 1  # uncompiled while a separate process compiles the shape: counted, shown
            self.stats.uncompiled_while_compiling += 1
            return call.run(self._dm)
        else:  # artifacts recorded for this model's kernel-cache file only; the CPU ISA list the options set: not kept
            recording = self.cache.recording() if self.cache is not None else contextlib.nullcontext()
            with self.telemetry.first_call(key, call.transformer_options, call.x) as watch, recording, \
                    torch_internals.vec_isa_list_kept():
                out = self.runner(key, call, watch.loading_package)
            if self.cache is not None:
                self.cache.save()
            if self.separate is not None:  # the index of the shape's per-block packages
                self.separate.record(self, key, call)
        self.telemetry.count_call(self.runner.paused)
        return out
