"""Small helpers shared by tests: run a FLUX diffusion model forward on fixed inputs."""
from __future__ import annotations

import torch


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
