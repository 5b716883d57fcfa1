"""Random-weight FLUX models and synthetic conditioning: the quickstart's model file, the Benchmark's and Warmup's
stand-in for text encoders, the GPU benchmarks' models (test-only fixtures are in tests/support/models.py).

No weights are downloaded: every model here is FLUX's real ComfyUI architecture with seeded random weights. A shape
is one of SHAPES or a FluxParams dict of the same form:
  e2e      hidden 256 (2 heads of 128), 1 double + 1 single block, FLUX.1's text and vector widths -- written to a
           .safetensors that ComfyUI's own UNETLoader detects as FLUX (ComfyUI 0.33+ reads the width from
           img_in.weight, heads = width / 128; e2e-schnell: the same without guidance embedding, FLUX.1-schnell)
  e2e-3072 FLUX.1's own width 3072 (24 heads), 1 double + 1 single block: the file that exercises loading at full
           width
  dev      FLUX.1-dev shape (19 double + 38 single blocks, guidance embedding)
  schnell  FLUX.1-schnell shape (no guidance embedding)
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger("fluxaccel.models")

_BASE = dict(
    image_model="flux", in_channels=16, out_channels=16, patch_size=2, mlp_ratio=4.0, theta=10000,
    qkv_bias=True, axes_dim=[16, 56, 56], num_heads=24, hidden_size=3072, context_in_dim=4096, vec_in_dim=768,
)
SHAPES: dict[str, dict] = {
    "e2e": {**_BASE, "hidden_size": 256, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "guidance_embed": True},
    "e2e-schnell": {**_BASE, "hidden_size": 256, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
                    "guidance_embed": False},
    "e2e-3072": {**_BASE, "depth": 1, "depth_single_blocks": 1, "guidance_embed": True},
    "dev": {**_BASE, "depth": 19, "depth_single_blocks": 38, "guidance_embed": True},
    "schnell": {**_BASE, "depth": 19, "depth_single_blocks": 38, "guidance_embed": False},
}


def unet_config(shape: str | dict) -> dict:
    """The unet_config ComfyUI's own detection would give this shape on the running host: ComfyUI 0.33's FluxParams
    also takes txt_ids_dims ([] for FLUX.1, as comfy/model_detection.py sets it); 0.3.75's does not accept it."""
    try:
        cfg = dict(shape) if isinstance(shape, dict) else dict(SHAPES[shape])
    except KeyError:
        raise ValueError(f"unknown FLUX shape {shape!r}; choose one of {sorted(SHAPES)}") from None
    import dataclasses

    import comfy.ldm.flux.model

    if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:
        cfg["txt_ids_dims"] = []
    return cfg


@torch.no_grad()
def init_random_(module: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random weights of sane scale: Linear weights ~ N(0, 1/fan_in), biases small, norm scales 1."""
    for i, (name, p) in enumerate(module.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        if name.endswith(("scale", "_norm.weight")):  # RMSNorm gains: .scale (0.3.75), .weight (0.33)
            p.fill_(1.0)
        elif p.dim() >= 2:
            fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(1 / math.sqrt(fan_in)))
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(0.02))


def save_atomic(sd: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors save under a per-process temporary name, then rename: two test sessions may write the same
    (seeded) file at once."""
    from safetensors.torch import save_file

    tmp = Path(path).with_suffix(f".tmp{os.getpid()}")
    save_file(sd, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def build_flux(shape: str | dict, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """A ComfyUI ModelPatcher around a random-weight FLUX built through comfy.supported_models.Flux."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    cfg = unet_config(shape)
    conf_cls = comfy.supported_models.Flux if cfg["guidance_embed"] else comfy.supported_models.FluxSchnell
    conf = conf_cls(cfg)
    conf.set_inference_dtype(dtype, None)
    model = conf.get_model({}, device=device)
    model.diffusion_model.to(device=device, dtype=dtype)
    init_random_(model.diffusion_model, seed)
    model.diffusion_model.eval()
    offload = comfy.model_management.unet_offload_device()
    load = torch.device(device)
    if load.type == "cuda" and load.index is None:
        load = comfy.model_management.get_torch_device()  # cuda:0, as ComfyUI's loaders set it ("cuda" != "cuda:0"
        # to its memory manager, which would then never unload the model)
    return comfy.model_patcher.ModelPatcher(model, load_device=load, offload_device=offload)


def write_flux_file(path: str | os.PathLike, shape: str | dict = "e2e", seed: int = 0, device="cpu") -> Path:
    """Write a bf16 FLUX .safetensors with every key of the architecture (what UNETLoader loads).

    Written once: an existing file is kept. Built tensor by tensor on `device` so a FLUX.1-dev-sized file
    (24 GB) never needs two copies in host memory.
    """

    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    import comfy.ldm.flux.model
    import comfy.ops

    cfg = unet_config(shape)
    params = {k: v for k, v in cfg.items() if k != "image_model"}
    with torch.device("meta"):
        meta = comfy.ldm.flux.model.Flux(dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init, **params)
    sd = {}
    for i, (name, p) in enumerate(meta.named_parameters()):
        t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
        holder = torch.nn.Module()
        holder.register_parameter(name.rsplit(".", 1)[-1], torch.nn.Parameter(t, requires_grad=False))
        init_random_(holder, seed * 7919 + i)
        # BFL's key names, which both hosts load: ComfyUI 0.33 names the QK-norm gains .weight and renames
        # *_norm.scale on load (comfy/supported_models.py); 0.3.75 names them .scale
        key = name[: -len(".weight")] + ".scale" if name.endswith("_norm.weight") else name
        sd[key] = t.cpu().contiguous()
    save_atomic(sd, path, metadata={"fluxaccel": f"random-weight FLUX shape={shape} seed={seed}"})
    log.info("wrote random-weight FLUX (%s) to %s", shape, path)
    return path


def _conditioning(context_dim: int, vec_dim: int, text_len: int, batch: int, guidance: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(batch, text_len, context_dim, generator=g)
    pooled = torch.randn(batch, vec_dim, generator=g)
    return [[context, {"pooled_output": pooled, "guidance": guidance}]]


def synthetic_conditioning(shape: str | dict, text_len: int = 16, batch: int = 1, guidance: float = 3.5,
                           seed: int = 0):
    """Hand-built FLUX conditioning [[context, {pooled_output, guidance}]] replacing the text encoders."""
    cfg = unet_config(shape)
    return _conditioning(cfg["context_in_dim"], cfg["vec_in_dim"], text_len, batch, guidance, seed)


def synthetic_conditioning_for(dm: torch.nn.Module, text_len: int, batch: int = 1, guidance: float = 3.5,
                               seed: int = 0):
    """The same, with the widths read off a FLUX diffusion model."""
    vec_dim = dm.vector_in.in_layer.in_features if dm.vector_in is not None else 768
    return _conditioning(dm.txt_in.in_features, vec_dim, text_len, batch, guidance, seed)
