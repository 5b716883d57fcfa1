import logging
import os
import uuid
from dataclasses import asdict

import comfy.samplers
import comfy.utils
import folder_paths
import torch
from comfy_api.latest import io, ui

from ..core import env
from ..core.budget import require_call_room, text_tokens
from ..core.inputs import conditioning
from ..core.bench import chart, results
from ..core.bench.benchmark import (BenchCase, Hooks, LEGEND, NODE, benchmark, check_label, markdown_table,
                                    rows_to_dicts, table_cells)
from ..core.bench.benchmark import notes as bench_notes
from ..core.compile.patch import compiled_of
from ..core.models.flux import require_flux
from ..core import patches
from ..core.models.synthetic import TEXT_LENGTH, TEXT_LENGTH_LIMIT, synthetic_conditioning_for
from ..core.upstream import comfy_internals
from . import ids
from .events import compiled_state
from .validation import parses

log = logging.getLogger("fluxaccel.bench")
_C = BenchCase()  # the case's defaults: the one home of the node's defaults


def zeroed(conditioning):
    """The conditioning with its tensors zeroed, as ComfyUI's ConditioningZeroOut makes a FLUX negative."""
    return [[torch.zeros_like(c), {k: torch.zeros_like(v) if torch.is_tensor(v) else v for k, v in extra.items()}]
            for c, extra in conditioning]


class Benchmark(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        top = comfy_internals.max_resolution()
        return io.Schema(
            node_id=ids.BENCHMARK,
            display_name="Benchmark (FluxAccel)",
            category=ids.CATEGORY,
            description="Runs the accelerated and the baseline model side by side in ComfyUI's sampler: seconds "
                        "per image and step, speedup, peak VRAM, first-run cost and denoiser fidelity.",
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                io.Model.Input("model", tooltip="The accelerated FLUX model (output of FluxAccel nodes)."),
                io.Model.Input("baseline", optional=True,
                               tooltip="Model to compare against; default: the same model with FluxAccel's patches removed."),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip="Conditioning to sample with; default: synthetic, text_length tokens."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Negative conditioning (used with cfg > 1); default: the positive zeroed "
                                              "out (as ConditioningZeroOut) when a positive is connected, else synthetic."),
                # the case's figures in view, the rest among the advanced inputs (the order is the one saved
                # workflows list their widget values in)
                io.Int.Input("text_length", default=TEXT_LENGTH, min=1, max=TEXT_LENGTH_LIMIT,
                             advanced=True, tooltip="Text tokens of the synthetic conditioning (no positive connected)."),
                io.Int.Input("width", default=_C.width, min=64, max=top, step=16, tooltip="Image width in pixels."),
                io.Int.Input("height", default=_C.height, min=64, max=top, step=16, tooltip="Image height in pixels."),
                io.Int.Input("steps", default=_C.steps, min=1, max=1000, tooltip="Sampling steps per image."),
                io.Int.Input("runs", default=_C.runs, min=1, max=100, tooltip="Timed runs per model (after one first run)."),
                io.Int.Input("seed", default=_C.seed, min=0, max=2**31 - 1, control_after_generate=True,
                             advanced=True, tooltip="Noise seed, the same for both models."),
                io.Float.Input("cfg", default=_C.cfg, min=1.0, max=30.0, step=0.1, advanced=True,
                               tooltip="CFG scale; >1 runs cond+uncond (batch 2)."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS, default=_C.sampler,
                               advanced=True, tooltip="Sampler."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default=_C.scheduler,
                               advanced=True, tooltip="Scheduler."),
                io.String.Input("label", default="", advanced=True,
                                tooltip="Name of the accelerated row; empty: derived from the model's patches."),
            ],
            outputs=[io.String.Output(display_name="table", tooltip="The results as a markdown table (also saved as "
                                                                    ".md and .json under output/fluxaccel)."),
                     io.Image.Output(display_name="chart", tooltip="The results drawn as a chart (also saved as .png "
                                                                   "under output/fluxaccel).")],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        """A new fingerprint every time: a queued Benchmark always measures again (not_idempotent only keeps ComfyUI
        from sharing its cache entry between nodes; an unchanged prompt would return the old table)."""
        return uuid.uuid4().hex

    @classmethod
    def validate_inputs(cls, label=""):
        return parses(check_label, label)

    @classmethod
    def execute(cls, model, text_length, width, height, steps, runs, seed, cfg, sampler_name, scheduler, label,
                baseline=None, positive=None, negative=None) -> io.NodeOutput:
        dm = require_flux(model, NODE, "measures")
        if baseline is not None:
            require_flux(baseline, NODE, "measures", "baseline")
        conditioning(positive, NODE, "positive")
        conditioning(negative, NODE, "negative")
        base = baseline if baseline is not None else patches.strip(model)
        negative = negative or (zeroed(positive) if positive else None)
        positive = positive or synthetic_conditioning_for(dm, text_length, seed=seed)
        negative = negative or synthetic_conditioning_for(dm, positive[0][0].shape[1], seed=seed + 1)
        case = BenchCase(width=width, height=height, steps=steps, runs=runs, seed=seed, cfg=cfg,
                         sampler=sampler_name, scheduler=scheduler)
        require_call_room(NODE, f"width and height {width}x{height}", model, width, height,
                          2 if cfg > 1 else 1, text_tokens(model, positive[0][0]))
        base_label = patches.label(base)
        models = [(base_label if "compile" in base_label else "eager-" + base_label, base),
                  (label or patches.label(model), model)]
        pbar = comfy.utils.ProgressBar(len(models) * (runs + 1) * steps)
        rows = benchmark(models, case, positive, negative,
                         Hooks(on_step=lambda step, total: pbar.update(1), describe=patches.describe))
        table = markdown_table(rows, case)
        rows_out = rows_to_dicts(rows)
        try:
            fig = chart.render(rows_out)
            image, png = chart.to_image_tensor(fig), chart.to_png(fig)
        except chart.ChartUnavailable as e:  # said in the table and the log; the figures are all in the table/JSON
            log.warning("FluxAccel Benchmark: no chart: %s", e)
            table += f"\n\n(no chart: {e})"
            image, png = torch.zeros(1, 64, 64, 3), None
        folder = os.path.join(folder_paths.get_output_directory(), "fluxaccel")
        files = results.save_run(folder, models[-1][0], {
            "case": asdict(case), "text_length": positive[0][0].shape[1], "env": env.describe(), "results": rows_out,
            "table": table}, table, png)
        log.info("FluxAccel Benchmark: results in %s (%s)", folder, ", ".join(files.values()))
        preview = ui.PreviewImage(image, cls=cls).as_dict()
        cells = table_cells(rows_out)
        cells["caption"] = table.split("\n", 1)[0]
        cells["notes"] = [*bench_notes(rows_out), LEGEND.replace("**bold**", "highlighted")]
        compiled = compiled_of(model)
        return io.NodeOutput(table, image, ui={
            **preview, "text": [table], "fluxaccel_table": [cells], "fluxaccel_json": [f"fluxaccel/{files['json']}"],
            # the badge shows the table's own cell (one rounding) and the model's compile state as measured
            "fluxaccel_speedup": [cells["rows"][-1]["cells"][cells["columns"].index("speedup vs its baseline") - 1]],
            "fluxaccel_compiled": [compiled_state(compiled) if compiled is not None else None]})
