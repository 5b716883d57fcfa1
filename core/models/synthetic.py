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
  e2e-flux2  FLUX.2 architecture at hidden 256 (2 heads), 1 double + 1 single block, [klein] 9B's text width
  klein-4b / klein-9b / flux2-dev   FLUX.2 [klein] 4B, [klein] 9B and [dev] 32B shapes
  e2e-chroma Chroma at its own width 3072 (ComfyUI's detection fixes Chroma's guidance network at 3072 wide),
           1 double + 1 single block
  chroma   Chroma's shape (19 double + 38 single blocks, the distilled guidance network)
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import comfy.ldm.chroma.model
import comfy.ldm.flux.model
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
from safetensors.torch import save_file
import torch

from ..upstream import comfy_internals

log = logging.getLogger("fluxaccel.models")

# The synthetic conditioning's text tokens where a node makes it (Synthetic FLUX Conditioning, Warmup, Benchmark):
# what ComfyUI's FLUX.1 T5 tokenizer pads a prompt to (FLUX.2's model pads its text to 512 itself); at most
# TEXT_LENGTH_LIMIT.
TEXT_LENGTH = 256
TEXT_LENGTH_LIMIT = 4096

_BASE = dict(
    image_model="flux", in_channels=16, out_channels=16, patch_size=2, mlp_ratio=4.0, theta=10000,
    qkv_bias=True, axes_dim=[16, 56, 56], num_heads=24, hidden_size=3072, context_in_dim=4096, vec_in_dim=768,
)
# FLUX.2 as comfy/model_detection.py (0.33) configures it; widths and depths per model below
_FLUX2 = dict(
    image_model="flux2", in_channels=128, out_channels=128, patch_size=1, mlp_ratio=3.0, theta=2000, qkv_bias=False,
    axes_dim=[32, 32, 32, 32], vec_in_dim=None, global_modulation=True, mlp_silu_act=True, ops_bias=False,
    default_ref_method="index", ref_index_scale=10.0, txt_ids_dims=[3], guidance_embed=False,
)
_CHROMA = dict(
    image_model="chroma", in_channels=64, out_channels=64, patch_size=2, mlp_ratio=4.0, theta=10000, qkv_bias=True,
    axes_dim=[16, 56, 56], num_heads=24, hidden_size=3072, context_in_dim=4096, vec_in_dim=None, in_dim=64,
    out_dim=3072, hidden_dim=5120, n_layers=5, txt_ids_dims=[],
)
SHAPES: dict[str, dict] = {
    "e2e": {**_BASE, "hidden_size": 256, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "guidance_embed": True},
    "e2e-schnell": {**_BASE, "hidden_size": 256, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
                    "guidance_embed": False},
    "e2e-3072": {**_BASE, "depth": 1, "depth_single_blocks": 1, "guidance_embed": True},
    "dev": {**_BASE, "depth": 19, "depth_single_blocks": 38, "guidance_embed": True},
    "schnell": {**_BASE, "depth": 19, "depth_single_blocks": 38, "guidance_embed": False},
    "e2e-flux2": {**_FLUX2, "hidden_size": 256, "num_heads": 2, "context_in_dim": 12288, "depth": 1,
                  "depth_single_blocks": 1},
    "klein-4b": {**_FLUX2, "hidden_size": 3072, "num_heads": 24, "context_in_dim": 7680, "depth": 5,
                 "depth_single_blocks": 20},
    "klein-9b": {**_FLUX2, "hidden_size": 4096, "num_heads": 32, "context_in_dim": 12288, "depth": 8,
                 "depth_single_blocks": 24},
    "flux2-dev": {**_FLUX2, "hidden_size": 6144, "num_heads": 48, "context_in_dim": 15360, "depth": 8,
                  "depth_single_blocks": 48, "guidance_embed": True},
    "e2e-chroma": {**_CHROMA, "depth": 1, "depth_single_blocks": 1},
    "chroma": {**_CHROMA, "depth": 19, "depth_single_blocks": 38},
}


def _params_class(image_model: str):
    """ComfyUI's parameter dataclass of an architecture on the running host (Chroma has its own)."""
    if image_model == "chroma":
        return comfy.ldm.chroma.model.ChromaParams

    return comfy.ldm.flux.model.FluxParams


def unet_config(shape: str | dict) -> dict:
    """The unet_config ComfyUI's own detection would give this shape on the running host: the parameters its
    architecture's dataclass takes there."""
    try:
        cfg = dict(shape) if isinstance(shape, dict) else dict(SHAPES[shape])
    except KeyError:
        raise ValueError(f"unknown FLUX shape {shape!r}; choose one of {sorted(SHAPES)}") from None

    cfg.setdefault("txt_ids_dims", [])
    fields = {f.name for f in dataclasses.fields(_params_class(cfg["image_model"]))}
    missing = [k for k in cfg if k not in fields and k != "image_model" and cfg[k] not in ([], None, False)]
    if missing:
        raise ValueError(f"this ComfyUI cannot build the {cfg['image_model']} shape: its parameters lack "
                         f"{', '.join(missing)}")
    return {k: v for k, v in cfg.items() if k in fields or k == "image_model"}


def _model_config(cfg: dict):
    """The comfy.supported_models class ComfyUI's detection picks for this unet_config."""
    sm = comfy.supported_models
    if cfg["image_model"] == "chroma":
        return sm.Chroma(cfg)
    if cfg["image_model"] == "flux2":
        return sm.Flux2(cfg)
    if cfg["in_channels"] == 96:
        return sm.FluxInpaint(cfg)
    return (sm.Flux if cfg["guidance_embed"] else sm.FluxSchnell)(cfg)


def _module_class(image_model: str):
    if image_model == "chroma":
        return comfy.ldm.chroma.model.Chroma

    return comfy.ldm.flux.model.Flux


@torch.no_grad()
def init_random_(module: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random weights of sane scale: Linear weights ~ N(0, 1/fan_in), biases small, norm scales 1."""
    for i, (name, p) in enumerate(module.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        if name.endswith(("scale", "_norm.weight")) or ".norms." in name:  # RMSNorm gains (.scale in BFL's files)
            p.fill_(1.0)
        elif p.dim() >= 2:
            fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(1 / math.sqrt(fan_in)))
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(0.02))


def save_atomic(sd: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors save under a per-process temporary name, then rename: two test sessions may write the same
    (seeded) file at once."""

    tmp = Path(path).with_suffix(f".tmp{os.getpid()}")
    save_file(sd, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def build_flux(shape: str | dict, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """A ComfyUI ModelPatcher around a random-weight FLUX built through the comfy.supported_models class ComfyUI's
    detection picks for it (Flux, FluxSchnell, FluxInpaint, Flux2, Chroma)."""

    conf = _model_config(unet_config(shape))
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


def _meta_model(shape: str | dict) -> torch.nn.Module:
    """The architecture's diffusion model on the meta device (shapes only, nothing allocated)."""
    cfg = unet_config(shape)
    with torch.device("meta"):
        return _module_class(cfg["image_model"])(dtype=torch.bfloat16, operations=comfy_internals.eager_init_ops(),
                                                 **{k: v for k, v in cfg.items() if k != "image_model"})


def param_count(shape: str | dict) -> int:
    """Parameters of the architecture."""
    return sum(p.numel() for p in _meta_model(shape).parameters())


def random_state_dict(shape: str | dict, seed: int = 0, device="cpu"):
    """(key, bf16 CPU tensor) of a random-weight FLUX with every key of the architecture, built tensor by tensor on
    `device` (a FLUX.1-dev-sized model, 24 GB, never needs two copies in host memory)."""
    meta = _meta_model(shape)
    for i, (name, p) in enumerate(meta.named_parameters()):
        t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
        holder = torch.nn.Module()
        holder.register_parameter(name.rsplit(".", 1)[-1], torch.nn.Parameter(t, requires_grad=False))
        init_random_(holder, seed * 7919 + i)
        # BFL's key names: ComfyUI names the QK-norm gains .weight and renames *_norm.scale on load
        # (comfy/supported_models.py)
        key = name[: -len(".weight")] + ".scale" if name.endswith("_norm.weight") else name
        yield key, t.cpu().contiguous()


def write_flux_file(path: str | os.PathLike, shape: str | dict = "e2e", seed: int = 0, device="cpu") -> Path:
    """Write a bf16 FLUX .safetensors with every key of the architecture (what UNETLoader loads). Written once: an
    existing file is kept."""
    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = dict(random_state_dict(shape, seed, device))
    save_atomic(sd, path, metadata={"fluxaccel": f"random-weight FLUX shape={shape} seed={seed}"})
    log.info("wrote random-weight FLUX (%s) to %s", shape, path)
    return path


def block_linears(shape: str | dict) -> list[str]:
    """The names (relative to the diffusion model) of every Linear in the architecture's blocks."""
    return [n for n, m in _meta_model(shape).named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith(("double_blocks.", "single_blocks."))]


def write_lora_file(path: str | os.PathLike, shape: str | dict, rank: int = 16, seed: int = 7,
                    targets: list[str] | None = None) -> Path:
    """Write a random rank-`rank` LoRA in ComfyUI's generic format (diffusion_model.<layer>.lora_up/lora_down, bf16)
    on `targets` (default: every block Linear) of a random-weight FLUX of `shape`: up @ down has entries of about a
    tenth of init_random_'s weights. Written once: an existing file is kept."""
    path = Path(path)
    if path.exists():
        return path
    meta, g, sd = _meta_model(shape), torch.Generator().manual_seed(seed), {}
    for name in targets or block_linears(shape):
        out_f, in_f = meta.get_submodule(name).weight.shape
        s = (0.1 / math.sqrt(in_f) / math.sqrt(rank)) ** 0.5
        sd[f"diffusion_model.{name}.lora_up.weight"] = (torch.randn(out_f, rank, generator=g) * s).bfloat16()
        sd[f"diffusion_model.{name}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) * s).bfloat16()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(sd, path, metadata={"fluxaccel": f"random LoRA rank={rank} shape={shape} seed={seed}"})
    log.info("wrote a random rank-%d LoRA on %d Linears to %s", rank, len(sd) // 2, path)
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
    return _conditioning(cfg["context_in_dim"], cfg.get("vec_in_dim") or 768, text_len, batch, guidance, seed)


def synthetic_conditioning_for(dm: torch.nn.Module, text_len: int, batch: int = 1, guidance: float = 3.5,
                               seed: int = 0):
    """The same, with the widths read off a FLUX diffusion model."""
    vector_in = getattr(dm, "vector_in", None)  # FLUX.2 has None, Chroma none at all: the pooled vector is unused
    vec_dim = vector_in.in_layer.in_features if vector_in is not None else 768
    return _conditioning(dm.txt_in.in_features, vec_dim, text_len, batch, guidance, seed)
