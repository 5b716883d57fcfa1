"""Sequence parallelism on the CPU: two worker processes joined by torch.distributed's gloo backend, tiny FLUX.1 and
FLUX.2 from ComfyUI's own classes in float32. The parallel model call equals the single-process one, for token
counts that split evenly over the workers and for ones that do not; LoRAs and reference latents apply; a killed
worker gives a clear error and the next call starts the workers again."""
import os
import signal

import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.parallel.config import ParallelConfig
from fluxaccel.core.parallel.patch import apply_parallel, kind_of
from fluxaccel.core.parallel.workers import WorkerDied
from support.models import build_flux
from support.runs import denoise_once
from support.shapes import TINY, TINY_FLUX2

TOL = 1e-5  # float32: the same arithmetic, attention summed in another order


@pytest.fixture
def parallel():
    """apply_parallel(model) with 2 workers (running ComfyUI's block code, unless compile_blocks); every worker
    stopped at the end."""
    made = []

    def make(model, gpus=2, compile_blocks=False):
        clone, p = apply_parallel(model, ParallelConfig(gpus=gpus, timeout_s=300, compile_blocks=compile_blocks))
        made.append(p)
        return clone, p

    yield make
    for p in made:
        p.workers.stop()


@pytest.mark.parametrize("shape, sizes, refs", [
    (TINY, ((16, None, 16), (14, 18, 7), (10, 16, 16)), ((8, 12),)),  # 64 image tokens (2x2), 63, 40; text 16, 7
    (TINY_FLUX2, ((8, None, 16), (7, 9, 7)), ((6, 5),))])  # 64 image tokens (1x1 patches), 63; text 16 and 7
def test_the_parallel_call_equals_the_single_process_call(parallel, shape, sizes, refs):
    """Token counts that split evenly over the two workers and ones that do not: the same output as the model in
    this process, to float32 rounding. A reference image's latent (FLUX.1 Kontext, FLUX.2 editing) is split with the
    image's tokens, with the same result."""
    base = build_flux(shape, dtype=torch.float32)
    model, p = parallel(base)
    for hw, w, text in sizes:
        ref = denoise_once(base, hw=hw, w=w, text_len=text)
        out = denoise_once(model, hw=hw, w=w, text_len=text)
        assert out.shape == ref.shape and rel_err(out, ref) < TOL, (hw, w, text, rel_err(out, ref))
    ref = denoise_once(base, hw=10, w=14, refs=refs)
    assert rel_err(denoise_once(model, hw=10, w=14, refs=refs), ref) < TOL
    assert rel_err(ref, denoise_once(base, hw=10, w=14)) > 1e-3  # the reference changes the output
    assert p.stats["calls"] == len(sizes) + 1 and p.stats["worker_starts"] == 1


def test_the_start_shows_its_progress_a_killed_worker_gives_a_clear_error_and_the_next_call_starts_them_again(
        parallel):
    """The workers' start shows its steps, and without CUDA devices every place that shows the workers says they are
    CPU workers; a killed worker ends the next call with a message that names it, and the call after that starts the
    workers again, also where the display of the progress fails."""
    from fluxaccel.core import patches

    base = build_flux("tiny", dtype=torch.float32)
    model, p = parallel(base)
    shown = []
    p.on_progress = lambda text, seconds: shown.append(text)
    ref = denoise_once(base)
    assert rel_err(denoise_once(model), ref) < TOL
    assert shown[:2] == ["starting 2 CPU workers (no CUDA device: gpus counts processes on this machine's CPU)",
                         "2 workers started"]
    assert shown[2].startswith("sending the workers the model (")
    assert shown[-1].startswith("2 workers ready in")
    assert patches.label(model) == "fp32+parallel-2cpu-workers"
    assert "split over 2 CPU workers (no CUDA device" in p.describe()
    victim = p.workers.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    with pytest.raises(WorkerDied, match=r"worker 1 \(cpu\) exited with code -9 .*the next prompt starts the "
                                         r"workers again"):
        denoise_once(model)
    assert not p.workers.procs  # every worker stopped
    p.on_progress = lambda text, seconds: (_ for _ in ()).throw(RuntimeError("no editor"))
    assert rel_err(denoise_once(model), ref) < TOL and p.workers.starts == 2


def test_what_cannot_run_across_gpus_is_refused_by_name(parallel):
    """ControlNet residuals and other nodes' block patches index the whole sequence; a model with heads that do not
    split over the workers cannot run: each refused with what to do, before any worker starts."""
    base = build_flux("tiny", dtype=torch.float32)
    model, p = parallel(base)
    x = torch.zeros(1, 16, 8, 8)
    with pytest.raises(FluxAccelError, match="ControlNet is not supported across GPUs.*Remove the ControlNet"):
        p._call({"x": x, "timestep": torch.ones(1), "control": {"input": [x]}})
    replace = {"patches_replace": {"dit": {("double_block", 0): print}}}
    with pytest.raises(FluxAccelError, match=r"block replacements \(dit\) cannot run across GPUs"):
        p._call({"x": x, "timestep": torch.ones(1), "transformer_options": replace})
    assert not p.workers.procs and p.workers.starts == 0
    with pytest.raises(FluxAccelError, match="2 attention heads do not split over 4 GPUs. Set gpus to a divisor of 2"):
        parallel(base, gpus=4)


def test_the_benchmark_baseline_runs_in_this_process_and_compile_refuses_a_parallel_model(parallel):
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.patches import strip

    base = build_flux("tiny", dtype=torch.float32)
    model, p = parallel(base)
    baseline = strip(model)
    assert torch.equal(denoise_once(baseline), denoise_once(base)) and p.workers.starts == 0
    with pytest.raises(FluxAccelError, match=r"runs across GPUs \(Parallel\).*Remove Compile \+ CUDA Graph, or the "
                                             r"Parallel node"):
        apply_compile(model, CompileConfig(separate_process=False))


def test_without_yunchang_the_node_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "yunchang" else real(name, *a))
    with pytest.raises(FluxAccelError, match=r"needs yunchang .*pip install 'yunchang>=0.6'"):
        apply_parallel(build_flux("tiny", dtype=torch.float32), ParallelConfig())


def test_cancel_ends_the_call_and_the_workers_serve_the_next_one(parallel):
    """Cancel (ComfyUI's interrupt flag) during a model call: the call in flight finishes on the workers, then the
    prompt ends as cancelled; the same workers run the next call."""
    import comfy.model_management as mm

    base = build_flux("tiny", dtype=torch.float32)
    model, p = parallel(base)
    ref = denoise_once(base)
    assert rel_err(denoise_once(model), ref) < TOL
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            denoise_once(model)
    finally:
        mm.interrupt_current_processing(False)
    assert rel_err(denoise_once(model), ref) < TOL and p.workers.starts == 1 and p.workers.calls == 3


def test_an_fp8_model_runs_across_the_workers(parallel, cpu_fp8):
    """Quantize FP8's clone (its FP8 Linears rebuilt in each worker from the model's skeleton, their data sent as
    weights): the parallel call equals the FP8 model's call in this process. FP8 scales activations per token, so
    splitting the tokens changes no scale; what differs is bf16 rounding in attention summed in another order."""
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    fp8, _ = apply_fp8(build_flux("tiny"), Fp8Config())
    model, p = parallel(fp8)
    ref = denoise_once(fp8, hw=14, w=18)
    assert rel_err(denoise_once(model, hw=14, w=18), ref) < 2e-2 and p.stats["calls"] == 1


@pytest.mark.parametrize("shape, sizes", [(TINY, ((14, 18, 7), (16, None, 16))), (TINY_FLUX2, ((7, 9, 7),))])
def test_workers_with_compiled_blocks_equal_the_single_process_call(parallel, shape, sizes):
    """Each worker compiles each kind of block once per token count (FluxAccel's block table, the all-to-all traced
    inside it): the same output as the model in this process, at an uneven and an even token count, and again at the
    first without compiling again."""
    base = build_flux(shape, dtype=torch.float32)
    model, p = parallel(base, compile_blocks=True)
    graphs = []
    for hw, w, text in (*sizes, sizes[0]):
        assert rel_err(denoise_once(model, hw=hw, w=w, text_len=text), denoise_once(base, hw=hw, w=w,
                                                                                    text_len=text)) < 1e-4
        graphs.append(p.workers.compiled_graphs)
    # one graph per block kind per token count (dynamo's counter in the worker); the repeat compiles nothing
    assert graphs == [2 * (i + 1) for i in range(len(sizes))] + [2 * len(sizes)] and p.workers.starts == 1


def test_cancel_during_the_workers_compile_stops_them_within_two_seconds(parallel):
    """Cancel while the workers compile their blocks (their first call, seconds long): the prompt ends within 2 s of
    it, the workers are stopped, and the next call starts them again and runs."""
    import threading
    import time

    import comfy.model_management as mm

    base = build_flux("tiny", dtype=torch.float32)
    model, p = parallel(base, compile_blocks=True)
    p.workers.start(p.dm, p._stamp, kind_of(model))  # started beforehand: the call below is only the compile and the run
    pressed = []

    def cancel():
        pressed.append(time.monotonic())
        mm.interrupt_current_processing(True)

    timer = threading.Timer(0.5, cancel)
    timer.start()
    try:
        with pytest.raises(mm.InterruptProcessingException):
            denoise_once(model, hw=12, w=20, text_len=9)
        ended = time.monotonic()
    finally:
        timer.cancel()
        mm.interrupt_current_processing(False)
    assert pressed and ended - pressed[0] < 2.0 and not p.workers.procs
    assert rel_err(denoise_once(model), denoise_once(base)) < 1e-4 and p.workers.starts == 2


def test_clones_of_other_kinds_of_one_loaded_model_each_get_their_own_weights(parallel, cpu_fp8):
    """One loaded model through Parallel as an FP8 per_row clone, then a plain clone, then per_tensor, then per_row
    again: the workers rebuild the model for each kind (never a bf16 weight copied into an FP8 one, nor one FP8
    layout into another), and each call equals that clone's call in this process (bf16 attention summed in another
    order; per_tensor also scales each worker's share of the activations on its own)."""
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    base = build_flux("tiny")
    for kind, clone, tol in (("per_row", apply_fp8(base, Fp8Config("per_row"))[0], 2e-2), ("plain", base, 2e-2),
                             ("per_tensor", apply_fp8(base, Fp8Config("per_tensor"))[0], 5e-2),
                             ("per_row", apply_fp8(base, Fp8Config("per_row"))[0], 2e-2)):
        model, p = parallel(clone)
        ref = denoise_once(clone, hw=14, w=18)
        out = denoise_once(model, hw=14, w=18)
        assert rel_err(out, ref) < tol, (kind, rel_err(out, ref))
    assert p.workers.starts == 1 and p.workers.rebuilds == 3


def test_loras_apply_and_each_strength_change_sends_only_what_it_patched(parallel):
    """LoraLoaderModelOnly's clones (ComfyUI's own LoRA loading), a strength after another, each through the Parallel
    node: each equals its LoRA'd model in this process; every clone reuses the first's workers and sends them only
    the weights the LoRA patches. ComfyUI runs nodes under inference_mode, where a tensor's version cannot be read, and
    frees each strength's patched weights before it makes the next (the same sizes: the allocator may hand out the
    same block, and Python the same id): every strength still reaches the workers."""
    from support.models import lora_state_dict, with_lora

    base = build_flux("tiny", dtype=torch.float32)
    targets = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear2"]
    sd = lora_state_dict(base, targets)
    outs, first = [], None
    with torch.inference_mode():
        for strength in (1.0, 0.5, 0.25, 0.75, 1.0, 0.5):
            lora = with_lora(base, sd, strength)
            model, p = parallel(lora)
            ref = denoise_once(lora, hw=14, w=18)
            out = denoise_once(model, hw=14, w=18)
            assert rel_err(out, ref) < TOL, strength
            first = p if first is None else first
            assert p.workers is first.workers and first.workers.starts == 1
            if p is not first:
                assert p.stats["weights_sent"] == len(targets), strength  # the two patched weights, nothing else
            outs.append(out)
            del lora, model, ref
    assert rel_err(outs[1], outs[0]) > 1e-3
