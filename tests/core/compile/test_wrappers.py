"""core/compile/wrappers.py: other nodes' diffusion-model wrappers run around the compiled call, on ComfyUI's own
EasyCache and LazyCache nodes (float32, CPU: the compiled blocks without CUDA graphs)."""
import logging
import re

import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from support.models import build_flux
from support.runs import sample


def _cached(model, node: str):
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    cls = EasyCacheNode if node == "EasyCache" else LazyCacheNode
    # a threshold past any step's change, from the first step on: every step the cache may skip is skipped
    return cls.execute(model, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0, verbose=False).result[0]


def _skipped(caplog, node: str) -> list[str]:
    return re.findall(rf"{node} - skipped (\d+/\d+) steps", caplog.text)


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_a_cache_node_after_compile_skips_the_same_steps_as_eager_and_samples_the_same(node, caplog):
    caplog.set_level(logging.INFO)
    base = build_flux("tiny", dtype=torch.float32)
    eager = sample(_cached(base, node), steps=8, cfg=2.0)
    eager_said = _skipped(caplog, node)
    caplog.clear()
    compiled_model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    out = sample(_cached(compiled_model, node), steps=8, cfg=2.0)
    said = _skipped(caplog, node)
    assert said == eager_said and int(said[0].split("/")[0]) >= 3, (said, eager_said)  # steps were skipped, alike
    assert rel_err(out, eager) < 1e-4
    skipped = int(said[0].split("/")[0])
    assert compiled.stats.calls == 8 - skipped and compiled.stats.eager_calls == 0  # a skipped step: no model call


def test_the_wrapper_gets_the_models_own_arguments_and_the_compiled_call_none_of_its_wrappers():
    """A DIFFUSION_MODEL wrapper sees (x, timestep, context, y, guidance, ref_latents, control, transformer_options)
    as ComfyUI's FLUX forward hands them on; the compiled call inside it carries no diffusion-model wrapper."""
    from comfy.patcher_extension import WrappersMP

    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append((len(args), isinstance(args[-1], dict), "diffusion_model" in (args[-1].get("wrappers") or {})))
        return executor(*args, **kwargs)

    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test", wrapper)
    plain = base.clone()
    plain.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test", wrapper)
    out = sample(model, steps=2)
    assert seen == [(8, True, False)] * 2 and compiled.stats.calls == 2, seen  # around each compiled call
    seen.clear()
    assert rel_err(out, sample(plain, steps=2)) < 1e-4
    assert seen == [(8, True, True)] * 2, seen  # ComfyUI's own: inside the model's forward
