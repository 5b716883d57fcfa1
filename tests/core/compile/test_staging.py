"""core/compile/staging.py: the sampler's CPU inputs copied to the GPU before ComfyUI's blocking copy. The pinned,
non-blocking copy itself needs a GPU (bench/NOTES.md has its H200 A/B); here a recording copy stands in for it, and
the wrapper runs inside ComfyUI's real sampler and apply_model."""
import pytest
import torch

from fluxaccel.core.compile.staging import staged, staging_wrapper

CUDA = torch.device("cuda")


def recording_copy(seen: list):
    def copy(t, device):
        seen.append(t)
        return t.clone()
    return copy


def test_other_devices_stage_nothing():
    x, y = torch.ones(2), torch.ones(1)
    args, kwargs, n = staged((x, 3), {"y": y}, torch.device("cpu"))
    assert n == 0 and args[0] is x and kwargs["y"] is y


def test_top_level_cpu_tensors_staged_the_rest_left_as_it_is():
    seen: list = []
    x, y, opts, meta = torch.ones(2), torch.arange(3.0), {"sigmas": torch.zeros(1)}, torch.empty(2, device="meta")
    args, kwargs, n = staged((x, 0.5, None, opts), {"y": y, "m": meta}, CUDA, recording_copy(seen))
    assert n == 2 and seen == [x, y]  # transformer_options and tensors already off the CPU are not touched
    assert args[0] is not x and torch.equal(args[0], x) and torch.equal(kwargs["y"], y)
    assert args[1:] == (0.5, None, opts) and args[3] is opts and kwargs["m"] is meta


def test_staged_inputs_reach_comfyuis_apply_model_with_the_same_result(tiny_flux):
    """The wrapper in ComfyUI's own APPLY_MODEL chain, under its sampler: every call's CPU inputs (the latent, timestep,
    conditioning, pooled vector, guidance) go through the copy, and the sampled latent is the same bit for bit."""
    from comfy.patcher_extension import WrappersMP

    from support.runs import sample

    from fluxaccel.core.compile.stats import CompileStats

    seen: list = []
    stats = CompileStats()
    plain = sample(tiny_flux, steps=2)
    clone = tiny_flux.clone()
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "test-staging",
                               staging_wrapper(lambda executor, *a, **k: executor(*a, **k), CUDA, stats,
                                               recording_copy(seen)))
    assert torch.equal(sample(clone, steps=2), plain)
    assert stats.staged_tensors == len(seen) >= 6 and not stats.degradations  # two calls, each's CPU inputs
    shapes = {tuple(t.shape) for t in seen}
    assert (1, 16, 64) in shapes  # the text conditioning (16 tokens of the tiny model's 64-wide context)


def test_pinned_memory_refused_runs_comfyuis_copy_and_says_so_once(tiny_flux, caplog):
    """A copy that raises (pinned memory refused): the call runs unstaged with the same result, the failure is said
    once (the model's stats and the log), and later calls do not try again."""
    from comfy.patcher_extension import WrappersMP

    from fluxaccel.core.compile.stats import CompileStats
    from support.runs import sample

    tries = []

    def refused(t, device):
        tries.append(t)
        raise RuntimeError("CUDA error: out of memory (pinned)\nmore")

    stats = CompileStats()
    plain = sample(tiny_flux, steps=3)
    clone = tiny_flux.clone()
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "test-staging",
                               staging_wrapper(lambda executor, *a, **k: executor(*a, **k), CUDA, stats,
                                               copy=refused))
    assert torch.equal(sample(clone, steps=3), plain)
    assert len(tries) == 1 and stats.staged_tensors == 0
    assert [d.what for d in stats.degradations] == ["the sampler's inputs copied without waiting"]
    assert "out of memory (pinned)" in stats.degradations[0].why and "more" not in stats.degradations[0].why
    assert sum("pinned-memory copies of the sampler's inputs are off" in r.getMessage() for r in caplog.records) == 1
