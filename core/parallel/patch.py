"""The Parallel node on a ModelPatcher: a clone whose diffusion model is swapped, for each call, for one that sends
the call to the sequence-parallel workers (workers.py). ComfyUI's sampler, its step marks, its patches and LoRA
loading stay in this process; the workers get the weights as ComfyUI loaded them for this clone.

What the workers cannot honour is refused by name: ControlNet residuals and other nodes' per-block patches (they
index the whole sequence), FLUX.2's reference latents at timestep zero, attention masks. Other nodes' diffusion-model
wrappers (EasyCache, ...) run here, around the call. Chroma and Compile + CUDA Graph on the same model are refused:
the workers run ComfyUI's FLUX forward with each block kind compiled by themselves.
"""
from __future__ import annotations

import importlib.util
import logging
import weakref

from comfy.patcher_extension import WrappersMP
import torch

from ..compile.patch import compiled_of
from ..compile.progress import cancelled
from ..compile.wrappers import outer, run_around
from ..errors import FluxAccelError
from ..models.flux import FluxModel
from ..models import swaps
from ..models.loaded import PARALLEL_KEY
from ..models.patcher import stamp
from ..quant.patch import fp8_state
from ..upstream import comfy_internals
from .config import ParallelConfig
from .workers import Workers, where

log = logging.getLogger("fluxaccel.parallel")

NODE = "Parallel (FluxAccel)"
_WORKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> {ParallelConfig: Workers}
# what a model call's transformer_options may carry to the workers: values they read, picklable
PASSED_OPTIONS = ("rope_options", "sigmas", "cond_or_uncond")
REFUSED_OPTIONS = {"patches": "attention or block patches", "patches_replace": "block replacements"}


class ParallelFlux(torch.nn.Module):
    """Stands in for the diffusion model during a call: the call's inputs go to the workers, rank 0's output comes
    back. `workers` outlive the clone's calls; `dm` is the live diffusion model (its weights as loaded now)."""

    def __init__(self, model, workers: Workers, node: str):
        super().__init__()
        object.__setattr__(self, "model", model)  # the clone (not a submodule: the live model stays ComfyUI's)
        object.__setattr__(self, "dm", model.model.diffusion_model)
        self.workers, self.node = workers, node
        self.on_progress = None  # (text, seconds) -> None: the node's progress text in the editor (nodes/events.py)
        self.stats = {"calls": 0, "worker_starts": 0, "weights_sent": 0}

    def __getattr__(self, name):
        # BaseModel reads attributes of its diffusion_model (dtype, ...) while this stands in for it
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "dm"), name)

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):
        wrappers = outer(transformer_options)
        named = dict(x=x, timestep=timestep, context=context, control=control, **kwargs,
                     transformer_options=comfy_internals.without_diffusion_model_wrappers(transformer_options)
                     if wrappers else transformer_options)
        if wrappers:
            return run_around(self._call, self.dm, wrappers, named)
        return self._call(named)

    def _call(self, named: dict) -> torch.Tensor:
        options = named.pop("transformer_options", None) or {}
        self._refuse(named, options)
        starts = self.workers.starts
        self.stats["weights_sent"] += self.workers.ready(self.dm, self._stamp, kind_of(self.model), tell=self._tell)
        self.stats["worker_starts"] += self.workers.starts - starts
        x = named["x"]
        args = {k: v for k, v in named.items() if k != "control"}
        out = self.workers.call({"args": args, "transformer_options": {k: options[k] for k in PASSED_OPTIONS
                                                                        if k in options}}, cancelled)
        self.stats["calls"] += 1
        return out.to(device=x.device, dtype=x.dtype)

    def _tell(self, text: str) -> None:
        """Say how the workers' start goes: in the log, and as the node's progress text in the editor."""
        log.info("FluxAccel: %s: %s", self.node, text)
        if self.on_progress is None:
            return
        try:
            self.on_progress(text, 0.0)
        except (ImportError, AttributeError, RuntimeError, OSError, ValueError, TypeError) as e:
            # a display must never fail the prompt: said, and the start goes on
            log.warning("FluxAccel: %s: progress not shown in the editor (%s: %s)", self.node, type(e).__name__, e)

    def describe(self) -> str:
        """The node's text: where the workers run and what they have done so far."""
        w = self.workers
        state = "running" if w.procs else "start at the first model call"
        return (f"each model call's tokens split over {where(w.devices)}, attention "
                f"gathered by yunchang's Ulysses all-to-all; "
                f"{'each block kind compiled once in each worker' if w.cfg.compile_blocks else 'blocks uncompiled'}, "
                f"calls not captured into CUDA graphs; "
                f"workers {state}; {self.stats['calls']} call(s) so far")

    def _stamp(self, name: str) -> tuple[int, int]:
        """A weight's (state_dict name) generation stamp: what tells the workers it was written since they got it."""
        return stamp(self.model, f"diffusion_model.{name}")

    def _refuse(self, named: dict, options: dict) -> None:
        if named.get("control") is not None:
            raise FluxAccelError(f"{self.node}: ControlNet is not supported across GPUs (its residuals index the "
                                 f"whole sequence). Remove the ControlNet or the Parallel node.")
        for key, what in REFUSED_OPTIONS.items():
            found = {k: v for k, v in (options.get(key) or {}).items() if v}
            if found:
                raise FluxAccelError(f"{self.node}: another node's {what} ({', '.join(map(str, found))}) cannot run "
                                     f"across GPUs. Remove that node or the Parallel node.")
        if named.get("attention_mask") is not None:
            raise FluxAccelError(f"{self.node}: an attention mask cannot run across GPUs. Remove the node that sets "
                                 f"it or the Parallel node.")
        method = named.get("ref_latents_method", getattr(getattr(self.dm, "params", None), "default_ref_method", ""))
        if named.get("ref_latents") is not None and method == "index_timestep_zero":
            raise FluxAccelError(f"{self.node}: reference latents at timestep zero (ref_latents_method "
                                 f"'index_timestep_zero') cannot run across GPUs yet. Remove the Parallel node.")


def kind_of(clone) -> tuple:
    """What the workers' model is made of for this clone besides the loaded model's own Linears: its FP8 config and
    the activations fused into FP8 Linears (or none), and other nodes' object patches, by identity."""
    state = fp8_state(clone)
    ours = set(state.keys + state.fused_keys) if state is not None else set()
    fp8 = (tuple(state.config.key()), state.fused_keys) if state is not None else None
    return fp8, tuple(sorted((k, id(v)) for k, v in swaps.items(clone) if k not in ours))


def label(parallel: "ParallelFlux") -> str:
    """The Benchmark row's part for Parallel: '+parallel-2gpus', or '+parallel-2cpu-workers'."""
    d = parallel.workers.devices
    return f"+parallel-{len(d)}" + ("cpu-workers" if all(x == "cpu" for x in d) else "gpus")


def devices_for(cfg: ParallelConfig, load_device: torch.device, node: str) -> list[str]:
    """One device per worker: the first `gpus` CUDA devices on a CUDA machine; on the CPU, CPU processes."""
    if load_device.type != "cuda":
        log.warning("FluxAccel: %s: no CUDA device: %s", node, where(["cpu"] * cfg.gpus))
        return ["cpu"] * cfg.gpus
    have = torch.cuda.device_count()
    if have < cfg.gpus:
        raise FluxAccelError(f"{node}: gpus is {cfg.gpus} but this machine has {have} CUDA device(s). Set gpus to "
                             f"{have} or fewer, or leave the Parallel node out.")
    return [f"cuda:{i}" for i in range(cfg.gpus)]


def apply_parallel(model, cfg: ParallelConfig, node: str = NODE):
    """Return (a clone of `model` whose model calls run across `cfg.gpus` workers, its ParallelFlux); the input model
    is unchanged. The workers start at the first call."""
    if importlib.util.find_spec("yunchang") is None:
        raise FluxAccelError(f"{node} needs yunchang (sequence parallelism): python -m pip install 'yunchang>=0.6' "
                             f"into ComfyUI's Python, then restart ComfyUI.")
    flux = FluxModel.of(model, node)
    if compiled_of(flux.model) is not None:
        raise FluxAccelError(f"{node}: this model is compiled by Compile + CUDA Graph, whose compiled blocks cannot "
                             f"run across GPUs. Put Parallel before Compile's place, without Compile.")
    dm = flux.dm
    if not (hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks")) or flux.profile.name == "Chroma":
        raise FluxAccelError(f"{node}: {flux.profile.name} models cannot run across GPUs yet; FLUX.1 and FLUX.2 can.")
    heads = dm.num_heads
    if heads % cfg.gpus:
        raise FluxAccelError(f"{node}: this model's {heads} attention heads do not split over {cfg.gpus} GPUs. Set "
                             f"gpus to a divisor of {heads}.")
    clone = flux.clone()  # (ComfyUI's weight writes counted: generations.py)
    kept = _WORKERS.setdefault(flux.model.model, {})  # one set of workers per loaded model and config: another
    workers = kept.get(cfg) or kept.setdefault(cfg, Workers(cfg, devices_for(cfg, flux.device, node), node))
    parallel = ParallelFlux(clone, workers, node)  # LoRA strength gets them, and only the weights written
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, PARALLEL_KEY,
                               comfy_internals.swap_in_wrapper({"diffusion_model": parallel}))
    clone.set_attachments(PARALLEL_KEY, parallel)
    return clone, parallel


def parallel_of(model) -> ParallelFlux | None:
    return model.get_attachment(PARALLEL_KEY)


def remove_parallel(model):
    """A clone of `model` running in this process again (the Benchmark's baseline); the workers stay for others."""
    if parallel_of(model) is None:
        return model
    clone = model.clone()
    clone.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, PARALLEL_KEY)
    clone.remove_attachments(PARALLEL_KEY)
    return clone
