"""core/quant/store.py: one FP8 set per loaded model and config, written by ComfyUI's own load through FluxAccel's
patcher, through long runs of LoRA changes and config changes, against eager ComfyUI running the same LoRA nodes."""
import gc
import random
import weakref

import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.models.patcher import owner_of
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.models import build_flux, lora_state_dict, with_lora
from support.runs import clear_compile_counters, compiled_graphs, sample

BOUND = 0.08  # FP8 against eager bf16, as the other LoRA tests
CHANGES = 50


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _draws(seed: int = 0) -> list[tuple]:
    """CHANGES settings drawn with a fixed seed: (label, [(lora, strength), ...] before Quantize FP8, [...] after)."""
    rng = random.Random(seed)
    kinds = [lambda: ("strength", [("a", rng.choice((0.25, 0.5, 0.75, 1.0, 1.5)))], []),
             lambda: ("swap", [("b", 1.0)], []),
             lambda: ("stack", [("a", 1.0), ("b", 0.6)], []),
             lambda: ("remove", [], []),
             lambda: ("after", [], [("a", rng.choice((0.5, 1.0)))]),
             lambda: ("before+after", [("b", 0.8)], [("a", 0.5)])]
    return [rng.choice(kinds)() for _ in range(CHANGES)]


def _with(model, loras, sds):
    for name, strength in loras:
        model = with_lora(model, sds[name], strength)
    return model


@pytest.fixture
def loras(tiny_flux):
    targets = ["double_blocks.0.img_attn.qkv", "double_blocks.1.img_mlp.0", "single_blocks.0.linear1",
               "single_blocks.1.linear2"]
    return {"a": lora_state_dict(tiny_flux, targets, seed=1), "b": lora_state_dict(tiny_flux, targets[1:], seed=2)}


def test_fifty_lora_changes_through_quantize_and_compile_follow_eager_comfyui(cpu_fp8, tiny_flux, loras):
    """Fifty changes (strengths, a swap, a stack of two, removal, a LoRA after Quantize FP8, both), each through
    LoraLoaderModelOnly -> Quantize FP8 -> [LoraLoaderModelOnly] -> Compile: every image equals eager ComfyUI's with
    the same LoRAs within FP8's error; nothing is compiled again (dynamo's counters); the FP8 buffers keep their
    addresses; the host's memory is flat from the 10th change to the 50th."""
    cfg = CompileConfig(separate_process=False)
    clear_compile_counters()
    graphs, pointers, rss = None, None, {}
    for i, (label, before, after) in enumerate(_draws(), 1):
        fp8, _ = apply_fp8(_with(tiny_flux, before, loras), Fp8Config())
        model, compiled = apply_compile(_with(fp8, after, loras), cfg)
        out = sample(model, steps=1, hw=8)
        eager = sample(_with(tiny_flux, before + after, loras), steps=1, hw=8)
        assert rel_err(out, eager) < BOUND, (i, label, rel_err(out, eager))
        assert compiled.stats.eager_calls == 0
        buffers = {n: (m.weight.data_ptr(), m.fp8_weight_scale.data_ptr()) for n, m in owner_of(model).fp8.items()}
        if graphs is None:
            graphs, pointers = compiled_graphs(), buffers
        assert compiled_graphs() == graphs and buffers == pointers, (i, label)
        if i in (10, CHANGES):
            gc.collect()
            rss[i] = _rss()
    assert abs(rss[CHANGES] - rss[10]) < 50 * 1024**2, rss


def test_fifty_lora_changes_through_quantize_and_parallel_follow_eager_comfyui(cpu_fp8, tiny_flux, loras):
    """The same fifty changes through Quantize FP8 -> [LoRA] -> Parallel (2 gloo workers): every call equals the same
    FP8 clone's call in this process, and eager ComfyUI's within FP8's error; the workers start once and get only the
    FP8 Linears each change wrote."""
    from fluxaccel.core.parallel.config import ParallelConfig
    from fluxaccel.core.parallel.patch import apply_parallel
    from support.runs import denoise_once

    cfg, workers = ParallelConfig(gpus=2, timeout_s=300), None
    try:
        for i, (label, before, after) in enumerate(_draws(), 1):
            fp8 = _with(apply_fp8(_with(tiny_flux, before, loras), Fp8Config())[0], after, loras)
            model, p = apply_parallel(fp8, cfg)
            workers = p.workers
            out, single = denoise_once(model, hw=8), denoise_once(fp8, hw=8)
            assert rel_err(out, single) < 2e-2, (i, label, rel_err(out, single))
            assert rel_err(out, denoise_once(_with(tiny_flux, before + after, loras), hw=8)) < BOUND, (i, label)
            # each FP8 Linear as 3 tensors (its data, scale, bias), and only those written since the last call
            assert p.stats["weights_sent"] % 3 == 0 and p.stats["weights_sent"] <= 3 * 4, (i, label, p.stats)
        assert workers.starts == 1 and workers.rebuilds == 0
    finally:
        if workers is not None:
            workers.stop()


def test_an_fp8_set_no_clone_uses_is_freed(cpu_fp8, tiny_flux):
    """per_row -> per_tensor -> per_row, each clone dropped once the next is loaded (as ComfyUI's cache drops a node's
    earlier output): at most one FP8 set per config a live clone uses stays in memory."""
    import comfy.model_management as mm

    sets = []

    def quantize(granularity):
        clone, _ = apply_fp8(tiny_flux, Fp8Config(granularity))
        mm.load_models_gpu([clone])
        sets.append(weakref.ref(owner_of(clone)))
        return clone

    row = quantize("per_row")
    tensor = quantize("per_tensor")
    del row
    row = quantize("per_row")
    del tensor
    gc.collect()
    alive = [s() for s in sets if s() is not None]
    assert alive == [owner_of(row)], alive
    compiled, _ = apply_compile(row, CompileConfig(separate_process=False))  # a compiled model does not hold it
    mm.load_models_gpu([compiled])
    del row, compiled, alive
    mm.load_models_gpu([tiny_flux])  # the plain model loaded: no FP8 Linear in its module tree
    gc.collect()
    assert [s() for s in sets if s() is not None] == []
