"""Small helpers shared by tests: run a FLUX diffusion model forward on fixed inputs, sample, denoise once."""
from __future__ import annotations

import torch


def clear_compile_counters() -> None:
    """Clear dynamo's counters and the warm-start package counts (what compiled_graphs reads)."""
    from torch._dynamo.utils import counters

    from fluxaccel.core.cache import packages as warm_start

    counters.clear()
    warm_start.counts.clear()


def compiled_graphs() -> int:
    """Compiled graphs this process has made since clear_compile_counters: traced by dynamo, or loaded from a
    warm-start package (which traces nothing: tests share the package folder, conftest.py)."""
    from torch._dynamo.utils import counters

    from fluxaccel.core.cache import packages as warm_start

    return counters["stats"]["unique_graphs"] + warm_start.counts["loaded"]


def flux_inputs(dm, batch=1, hw=16, text_len=16, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, hw, hw, generator=g).to(dtype)
    ctx = torch.randn(batch, text_len, dm.txt_in.in_features, generator=g).to(dtype)
    y = torch.randn(batch, dm.vector_in.in_layer.in_features, generator=g).to(dtype)
    t = torch.full((batch,), 0.6)
    guidance = torch.full((batch,), 3.5)
    return x, t, ctx, y, guidance


def forward(model, inputs, compiled=False):
    """Load `model` through ComfyUI's model management and run its diffusion model once."""
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    fn = torch.compile(dm, dynamic=False) if compiled else dm
    return fn(*inputs).float()


def sample(model, seed=0, steps=2, cfg=1.0, sampler="euler", hw=16, text_len=16, text_seed=0, batch=1):
    import comfy.sample

    from support.models import synthetic_conditioning

    pos = synthetic_conditioning("tiny", text_len=text_len, seed=text_seed)
    neg = synthetic_conditioning("tiny", text_len=text_len, seed=text_seed + 100)
    latent = torch.zeros(batch, 16, hw, hw)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, sampler, "simple", pos, neg, latent, disable_pbar=True, seed=seed)


def denoise_once(model, hw=16, text_len=16, refs=(), transformer_options=None, w=None):
    """One apply_model call (the denoiser forward) through ComfyUI's BaseModel, compile wrapper included; the
    conditioning's widths and the latent's channels are read off the model (any FLUX architecture, tiny or full
    width). refs: latent (H, W) of reference latents to pass (FLUX.1 Kontext, FLUX.2 editing); transformer_options:
    the call's (e.g. a block-region table); w: the latent's width where it differs from its height (hw)."""
    import comfy.model_management as mm
    from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers

    from support.models import synthetic_conditioning_for

    mm.load_models_gpu([model])
    g = torch.Generator().manual_seed(3)
    bm = model.model
    ch = bm.latent_format.latent_channels
    x = torch.randn(1, ch, hw, w or hw, generator=g)
    pos = synthetic_conditioning_for(model.model.diffusion_model, text_len)
    ctx, extra = pos[0]
    conds = bm.extra_conds(noise=x, device=x.device, cross_attn=ctx, pooled_output=extra["pooled_output"],
                           guidance=3.5, reference_latents=[torch.randn(1, ch, h, w, generator=g) for h, w in refs]
                           or None)
    kwargs = {k: v.cond if hasattr(v, "cond") else v for k, v in conds.items()}
    executor = WrapperExecutor.new_class_executor(bm._apply_model, bm, get_all_wrappers(
        WrappersMP.APPLY_MODEL, model.model_options, is_model_options=True) + model.get_all_wrappers(WrappersMP.APPLY_MODEL))
    return executor.execute(x, torch.tensor([0.7]), transformer_options=dict(transformer_options or {}),
                            **kwargs).float()


# The start of a script run in a new Python process (tests of what a restarted ComfyUI reuses): a real ComfyUI
# imported, the tiny FLUX model and fixed inputs x, t, ctx, y, gd; `{root}` is the repository. The test appends its
# own lines (braces doubled: the whole script goes through str.format).
NEW_PROCESS_PRELUDE = r"""
import json, logging, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/tests")
from tools.plugin import register; register()
logging.basicConfig(level=logging.INFO)
from tools import host; host.import_comfy()
from torch._dynamo.utils import counters
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.compiled import CompiledFlux, Setup
from support.models import build_flux
m = build_flux("tiny")
dm = m.model.diffusion_model
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 16, 16, 16, generator=g).bfloat16(); ctx = torch.randn(1, 16, 64, generator=g).bfloat16()
y = torch.randn(1, 64, generator=g).bfloat16(); t = torch.tensor([0.5]); gd = torch.tensor([3.5]).bfloat16()
"""


def repatches_per_prompt(monkeypatch, model) -> int:
    """comfy.utils.set_attr calls of one load_models_gpu of an already loaded model, as every prompt after the first
    makes it (ComfyUI 0.33 undoes and redoes each object patch)."""
    import comfy.model_management as mm
    import comfy.utils

    mm.load_models_gpu([model])
    calls, set_attr = [], comfy.utils.set_attr
    monkeypatch.setattr(comfy.utils, "set_attr", lambda *a, **k: calls.append(a[1]) or set_attr(*a, **k))
    mm.load_models_gpu([model])
    monkeypatch.setattr(comfy.utils, "set_attr", set_attr)
    return len(calls)
