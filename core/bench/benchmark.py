"""Side-by-side measurement of FLUX models inside ComfyUI's real sampler.

Every model runs the same case (seed, latent, conditioning, sampler): one first run each, accelerated models before
the baseline (load, compile, capture: `first_run_s`; `first_run_cached_s` where the plugin's persistent compile
cache was loaded), then `runs`
timed runs alternating between the models, device-synchronized at start and end (per-step times from CUDA events).
Fidelity is judged on single denoiser forwards at three sigmas against the baseline (random-weight FLUX
amplifies rounding over many sampling steps, so the final latent's error is reported but not judged).
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import comfy.model_management as mm
import comfy.sample
import comfy.samplers
import torch

from ..compile.patch import compiled_of
from ..errors import FluxAccelError
from ..models.flux import latent_scale
from .metrics import rel_err, sqnr_db

log = logging.getLogger("fluxaccel.bench")

NODE = "Benchmark (FluxAccel)"
FIDELITY_SIGMAS = (0.9, 0.5, 0.1)
LABEL_LIMIT = 100  # characters of a row's label (the table, the chart's legend, the results' file names)


def check_label(label) -> None:
    """A row label the table, the chart and the file names can carry, or an error naming the input."""
    if not isinstance(label, str):
        raise FluxAccelError(f"{NODE}: label must be text, got {type(label).__name__}")
    if len(label) > LABEL_LIMIT:
        raise FluxAccelError(f"{NODE}: label is {len(label)} characters long; write at most {LABEL_LIMIT}")


@dataclass
class BenchCase:
    width: int = 1024
    height: int = 1024
    steps: int = 28
    runs: int = 3
    seed: int = 0
    cfg: float = 1.0
    sampler: str = "euler"
    scheduler: str = "simple"
    batch: int = 1


@dataclass
class BenchRow:
    config: str
    first_run_s: float
    s_per_image_median: float
    s_per_step_median: float
    s_per_image_min: float
    s_per_image_max: float
    runs: list[float]
    step_times: list[float]
    peak_vram_gib: float | None
    denoiser_rel_err: float
    denoiser_sqnr_db: float
    denoiser_rel_err_per_sigma: list[float]
    final_latent_rel_err: float
    speedup_vs_baseline: float = 1.0
    baseline_s_per_image_median: float = 0.0  # the baseline measured alongside, in the same runs
    first_run_cached_s: float | None = None  # first_run_s again when the persistent compile cache was loaded
    extra: dict = field(default_factory=dict)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return None


def empty_latent(model, case: BenchCase) -> torch.Tensor:
    ch, scale = model.model.latent_format.latent_channels, latent_scale(model)
    return torch.zeros(case.batch, ch, case.height // scale, case.width // scale)


@dataclass(frozen=True)
class Hooks:
    """What a benchmark tells as it runs: on_progress(message) what runs; on_step(step, total) after every sampling
    step (total steps over the whole benchmark: len(models) * (runs + 1) * steps); describe(model) the row's `extra`."""

    on_progress: Callable[[str], None] | None = None
    on_step: Callable | None = None
    describe: Callable[[object], dict] | None = None

    def say(self, message: str) -> None:
        (self.on_progress or (lambda msg: log.info("%s", msg)))(message)


@dataclass(frozen=True)
class Runs:
    """What every sampling run of one benchmark uses: the case, the conditioning, the empty latent, the hooks."""

    case: BenchCase
    positive: object
    negative: object
    latent: torch.Tensor
    hooks: Hooks = Hooks()


def sample_timed(model, runs: Runs, timed_steps: bool = True):
    """One real ComfyUI sampling run; returns (latent, seconds, per-step seconds). Loading is not timed. timed_steps
    False: a warm-up run of one step, not told to on_step."""
    case = runs.case if timed_steps else replace(runs.case, steps=1)
    on_step = runs.hooks.on_step if timed_steps else None
    positive, negative, latent = runs.positive, runs.negative, runs.latent

    mm.load_models_gpu([model])
    dev = model.load_device
    noise = comfy.sample.prepare_noise(latent, case.seed)
    # Per-step times without a per-step synchronization: a sync after every step would leave the GPU idle while
    # the host prepares the next step (ComfyUI itself does not sync there unless previews are on). On a GPU each
    # step end is a CUDA event on the model's stream; on the CPU work is synchronous and the host clock is exact.
    use_events = torch.device(dev).type == "cuda"
    marks = []

    def stamp():
        if use_events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def cb(step, x0, x, total):
        marks.append(stamp())
        if on_step is not None:
            on_step(step, total)

    _sync(dev)
    t0 = time.perf_counter()
    start = stamp()
    out = comfy.sample.sample(model, noise, case.steps, case.cfg, case.sampler, case.scheduler, positive, negative,
                              latent, callback=cb, disable_pbar=True, seed=case.seed)
    _sync(dev)
    t1 = time.perf_counter()
    if use_events:
        steps = [a.elapsed_time(b) / 1000 for a, b in zip([start] + marks[:-1], marks)]
    else:
        steps = [b - a for a, b in zip([start] + marks[:-1], marks)]
    return out, t1 - t0, steps


def _one_denoiser_call(model, x, sigmas, extra_args=None, callback=None, disable=None):
    """A ComfyUI sampler function (comfy.samplers.KSAMPLER) that calls the denoiser once, at sigmas[0], and returns
    its prediction of the clean latent."""
    return model(x, sigmas[0] * x.new_ones([x.shape[0]]), **(extra_args or {}))


@torch.inference_mode()
def denoiser_outputs(model, case: BenchCase, positive, negative=None, sigmas=FIDELITY_SIGMAS) -> list[torch.Tensor]:
    """The model's denoised prediction for fixed inputs at each sigma (the 'single forward' check), through ComfyUI's
    own sampling path: a CFGGuider with the case's cfg and conditioning (the model's extra_conds, its wrappers,
    calc_cond_batch's batching), and a one-call sampler over the sigmas [s, 0]."""

    latent = empty_latent(model, case)
    g = torch.Generator().manual_seed(case.seed + 1)
    x0 = torch.randn(latent.shape, generator=g)
    noise = torch.randn(latent.shape, generator=g)
    guider = comfy.samplers.CFGGuider(model)
    guider.set_conds(positive, negative if negative is not None else positive)
    guider.set_cfg(case.cfg)
    sampler = comfy.samplers.KSAMPLER(_one_denoiser_call)
    return [guider.sample(noise, x0, sampler, torch.tensor([float(s), 0.0]), disable_pbar=True,
                          seed=case.seed).float().cpu() for s in sigmas]


def unique_labels(models: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Rows are keyed by label: a label that repeats gets ' #2', ' #3', ... so no row overwrites another."""
    seen: dict[str, int] = {}
    out = []
    for label, m in models:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} #{seen[label]}", m))
    return out


@contextlib.contextmanager
def _compiling_here(models):
    """The compiled models among `models` compile in their first call, in this process (CompiledFlux.compiling_here)."""

    with contextlib.ExitStack() as stack:
        for _, m in models:
            compiled = compiled_of(m)
            if compiled is not None:
                stack.enter_context(compiled.compiling_here())
        yield


def _first_runs(models, runs: Runs) -> tuple[dict, dict]:
    """Each model's first run (load, compile or cache load, capture): seconds and final latent.
    The accelerated models run before the baseline, so that an accelerated model's first run is what a fresh ComfyUI
    process pays for its first image, not also the switch away from a baseline loaded just before it."""

    dev = models[0][1].load_device
    first, latents = {}, {}
    for label, m in models[1:] + models[:1]:
        runs.hooks.say(f"{label}: first run (load, compile, capture)")
        _sync(dev)
        t0 = time.perf_counter()
        mm.load_models_gpu([m])
        latents[label], _, _ = sample_timed(m, runs)
        first[label] = time.perf_counter() - t0
    return first, latents


def _timed_runs(models, runs: Runs) -> tuple[dict, dict, dict]:
    """case.runs timed runs per model, alternating A/B/... so drift (clocks, heat) hits every model alike: seconds
    per run, step times per run, peak VRAM (GiB, None off CUDA)."""

    dev = models[0][1].load_device
    times, steps, peaks = {label: [] for label, _ in models}, {label: [] for label, _ in models}, {}
    for r in range(runs.case.runs):
        for label, m in models:
            runs.hooks.say(f"{label}: timed run {r + 1}/{runs.case.runs}")
            mm.load_models_gpu([m])
            # one untimed step: after a model switch, weights may sit at new addresses and CUDA graphs re-record
            sample_timed(m, runs, timed_steps=False)
            _reset_peak(dev)
            _, secs, st = sample_timed(m, runs)
            peak = _peak_gib(dev)
            peaks[label] = max(peaks.get(label) or 0.0, peak) if peak is not None else None
            times[label].append(secs)
            steps[label].append(st)
    return times, steps, peaks


def benchmark(models: list[tuple[str, object]], case: BenchCase, positive, negative,
              hooks: Hooks = Hooks()) -> list[BenchRow]:
    """Measure each (label, ModelPatcher); the first one is the baseline (speedup and errors against it)."""
    models = unique_labels(models)
    runs = Runs(case, positive, negative, empty_latent(models[0][1], case), hooks)
    with _compiling_here(models):  # the first run's cost is the compile's (or waits for a separate one running)
        first, latents = _first_runs(models, runs)
        times, steps, peaks = _timed_runs(models, runs)
    hooks.say("fidelity: denoiser forwards at sigmas " + ", ".join(map(str, FIDELITY_SIGMAS)))
    den = {label: denoiser_outputs(m, case, positive, negative) for label, m in models}
    base = models[0][0]
    rows = []
    for label, m in models:
        per_sigma = [rel_err(o, r) for o, r in zip(den[label], den[base])]
        cat_o, cat_r = torch.cat([o.flatten() for o in den[label]]), torch.cat([o.flatten() for o in den[base]])
        med = statistics.median(times[label])
        step_med = [statistics.median(s) for s in zip(*steps[label])] if steps[label] and steps[label][0] else []
        rows.append(BenchRow(
            config=label, first_run_s=first[label], s_per_image_median=med, s_per_step_median=med / case.steps,
            s_per_image_min=min(times[label]), s_per_image_max=max(times[label]), runs=times[label],
            step_times=step_med, peak_vram_gib=peaks.get(label), denoiser_rel_err=rel_err(cat_o, cat_r),
            denoiser_sqnr_db=sqnr_db(cat_o, cat_r), denoiser_rel_err_per_sigma=per_sigma,
            final_latent_rel_err=rel_err(latents[label], latents[base]),
            extra=hooks.describe(m) if hooks.describe else {},
        ))
        if (rows[-1].extra.get("compile") or {}).get("cache_loaded"):
            rows[-1].first_run_cached_s = first[label]
    for row in rows:
        row.speedup_vs_baseline = rows[0].s_per_image_median / row.s_per_image_median
        row.baseline_s_per_image_median = rows[0].s_per_image_median
    return rows


def rows_to_dicts(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]


NOISY = 0.10  # a row whose timed runs spread over more than this fraction of their median is called out


def spread_fraction(r: dict) -> float | None:
    """(max - min) / median of a row's timed runs; None with fewer than two runs."""
    runs = r.get("runs") or []
    if len(runs) < 2 or not r["s_per_image_median"]:
        return None
    return (max(runs) - min(runs)) / r["s_per_image_median"]


def _spread_cell(r: dict) -> str | None:
    runs = r.get("runs") or []
    if not runs:
        return None
    if len(runs) == 1:
        return "1 run"
    return f"{min(runs):.3f}-{max(runs):.3f} ({len(runs)} runs)"


LEGEND = ("**bold**: the best value of each column. speedup: the row's baseline s/image (same runs) / its own. spread: "
          "the fastest and slowest timed run. denoiser rel err / SQNR: one denoiser call at sigmas 0.9, 0.5 and 0.1 "
          "against the row's baseline (lower / higher is closer; '-' on the baseline itself).")


def notes(rows: list[dict]) -> list[str]:
    """Lines under the table: which rows are too noisy to read a speedup from."""
    noisy = [f"{r['config']} ({100 * f:.0f} %)" for r in rows if (f := spread_fraction(r)) is not None and f > NOISY]
    if not noisy:
        return []
    return [f"Noisy: the timed runs of {', '.join(noisy)} spread over more than {100 * NOISY:.0f} % of their median; "
            f"raise runs (or close other programs) before reading a speedup from them."]


def markdown_table(rows: list[BenchRow], case: BenchCase) -> str:
    head = (f"FLUX {case.width}x{case.height}, {case.steps} {case.sampler} steps, cfg {case.cfg}, "
            f"{case.runs} timed runs each\n\n")
    dicts = rows_to_dicts(rows)
    return head + markdown_rows(dicts) + "\n\n" + "\n".join([*notes(dicts), LEGEND])


# column: (heading, value of a row dict, format, which is best: min or max); None where a row has no value. The
# columns a person decides by first come first (the node shows them at its shipped width).
_COLUMNS = (
    ("s/image (median)", lambda r: r["s_per_image_median"], "{:.3f}", min),
    ("speedup vs its baseline", lambda r: r["speedup_vs_baseline"], "{:.2f}x", max),
    ("spread s (runs)", _spread_cell, "{}", None),
    ("baseline s/image", lambda r: r.get("baseline_s_per_image_median") or r["s_per_image_median"], "{:.3f}", None),
    ("ms/step", lambda r: 1000 * r["s_per_step_median"], "{:.1f}", min),
    ("first run s", lambda r: r["first_run_s"], "{:.1f}", min),
    ("peak VRAM GiB", lambda r: r.get("peak_vram_gib"), "{:.2f}", min),
    ("denoiser rel err", lambda r: r["denoiser_rel_err"] or None, "{:.4f}", min),  # a baseline's own 0: not a value
    ("SQNR dB", lambda r: _finite(r.get("denoiser_sqnr_db")), "{:.1f}", max),  # null in strict JSON
)


def _finite(v):
    return v if v is not None and math.isfinite(v) else None


def table_cells(rows: list[dict]) -> dict:
    """The results table as cells: {"columns": headings, "rows": [{"config", "cells": texts, "best": flags}]}. Each
    row carries the baseline its speedup is against (rows of several Benchmark nodes have different ones); the best
    value of each column is flagged; a baseline row's error columns read '-' (it is the reference). The node's
    rendered table (web/fluxaccel.js) and markdown_rows are both made from it."""
    values = [[get(r) for _, get, _, _ in _COLUMNS] for r in rows]
    best = []
    for i, (_, _, _, pick) in enumerate(_COLUMNS):
        present = [v[i] for v in values if v[i] is not None]
        best.append(pick(present) if pick and len(present) > 1 else None)
    out = []
    for r, vals in zip(rows, values):
        out.append({"config": r["config"],
                    "cells": ["-" if v is None else fmt.format(v) for (_, _, fmt, _), v in zip(_COLUMNS, vals)],
                    "best": [v is not None and v == b for v, b in zip(vals, best)]})
    return {"columns": ["config"] + [h for h, _, _, _ in _COLUMNS], "rows": out}


def markdown_rows(rows: list[dict]) -> str:
    """table_cells as a markdown table (the node's copyable text, the headless command's terminal table), the best
    value of each column in bold."""
    t = table_cells(rows)
    lines = ["| " + " | ".join(t["columns"]) + " |", "|---" * len(t["columns"]) + "|"]
    for r in t["rows"]:
        cells = [f"**{c}**" if b else c for c, b in zip(r["cells"], r["best"])]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
