"""What a compiled model keeps on disk and compiles beside the server, as its config asks: the kernel cache
(cache/kernels.py), the warm-start packages (cache/packages.py) and the separate-process compiles (separate.py);
each one off says why, in the stats (node text, badge) and the log."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..cache import packages as warm_start
from ..cache.kernels import KernelCache
from .separate import SeparateCompiles

log = logging.getLogger("fluxaccel.compile")


@dataclass
class Persistence:
    cache: object = None  # KernelCache, or None
    packages: object = None  # Packages, or None
    separate: object = None  # SeparateCompiles, or None


def open_for(cfg, setup, stats) -> Persistence:
    """The kernel cache loaded, the saved packages of this key loading in the background (a restart: they load while
    ComfyUI moves the weights, not at the first model call) and the separate compiles, as `cfg` asks; `setup` is
    the CompiledFlux's (compiled.Setup: its key, device and inductor options), `stats` its CompileStats."""
    if not cfg.persistent_cache:
        return Persistence()

    cache = KernelCache(setup.cache_key)
    stats.cache_loaded = cache.load()
    if cfg.dynamic_tokens:  # one compile for every token count: no per-shape packages or separate compiles
        return Persistence(cache)
    usable, why = warm_start.available()
    if not usable:
        stats.warm_start_off = why
        stats.degrade("warm start", f"{why}; a restarted ComfyUI traces the blocks again")
        log.warning("FluxAccel: no warm-start packages: %s; a restarted ComfyUI traces the blocks again", why)
        if cfg.separate_process:
            why = f"it needs warm-start packages, and there are none here ({why})"
            stats.degrade("compile in a separate process", f"{why}; a new shape compiles in its first call")
            log.warning("FluxAccel: no compile in a separate process: %s; a new shape compiles in its first call", why)
        return Persistence(cache)
    packages = warm_start.Packages(warm_start.WarmStart(cache.key, cache.dir), setup.options)
    packages.prefetch(cfg.max_shapes * 2, setup.device)  # one package per block kind and shape
    if not cfg.separate_process:
        return Persistence(cache, packages)

    return Persistence(cache, packages, SeparateCompiles(packages.store, cfg, setup.device, setup.options))
