"""Test fixtures: the tiny FLUX built in-process for CPU unit tests, and the files that only tests and the
reliability tool need (a scaled-FP8 checkpoint, a LoRA). Product synthetic models are in core/models/synthetic.py."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tools.plugin import register

register()
from fluxaccel.core.models import synthetic  # noqa: E402
from fluxaccel.core.models.synthetic import SHAPES, save_atomic, write_flux_file  # noqa: E402,F401
from support.shapes import TINY  # noqa: E402

log = logging.getLogger("fluxaccel.tests")



def _shape(shape):
    return TINY if shape == "tiny" else shape


def build_flux(shape="tiny", dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """A ModelPatcher around a random-weight FLUX (synthetic.build_flux), "tiny" by default."""
    return synthetic.build_flux(_shape(shape), dtype=dtype, device=device, seed=seed)


def synthetic_conditioning(shape="tiny", text_len: int = 16, batch: int = 1, guidance: float = 3.5, seed: int = 0):
    return synthetic.synthetic_conditioning(_shape(shape), text_len, batch, guidance, seed)


synthetic_conditioning_for = synthetic.synthetic_conditioning_for


SCALED_FP8_LAYERS = r"^(double_blocks|single_blocks)\.\d+\..*(qkv|proj|mlp\.\d|linear\d|_mod\.lin|modulation\.lin)$|^(img_in|txt_in)$"


def write_scaled_fp8_file(path: str | os.PathLike, bf16_file: str | os.PathLike) -> Path:
    """Write a scaled-FP8 checkpoint in ComfyUI's mixed-precision format (QUANTIZATION.md of ComfyUI 0.33) from a bf16
    FLUX file: the block Linears, the modulation and the image/text input embedders stored as float8_e4m3fn with a
    per-tensor `weight_scale`, listed in the `_quantization_metadata` entry; everything else in bf16."""
    import json
    import re

    from safetensors.torch import load_file

    path = Path(path)
    if path.exists():
        return path
    sd, layers = load_file(str(bf16_file)), {}
    pattern = re.compile(SCALED_FP8_LAYERS)
    for key in [k for k in sd if k.endswith(".weight")]:
        layer = key[: -len(".weight")]
        w = sd[key]
        if w.ndim != 2 or not pattern.match(layer):
            continue
        scale = w.float().abs().amax().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        sd[key] = (w.float() / scale).to(torch.float8_e4m3fn)
        sd[f"{layer}.weight_scale"] = scale.reshape(())
        layers[layer] = {"format": "float8_e4m3fn"}
    save_atomic(sd, path, metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers}),
                                    "fluxaccel": f"scaled-FP8 (per-tensor e4m3fn) copy of {Path(bf16_file).name}"})
    log.info("wrote scaled-FP8 FLUX (%d layers) to %s", len(layers), path)
    return path


LORA_TARGETS = ("double_blocks.0.img_attn.qkv", "double_blocks.0.img_mlp.0", "single_blocks.0.linear1",
                "single_blocks.0.linear2")


def write_lora_file(path: str | os.PathLike, flux_file: str | os.PathLike, targets=LORA_TARGETS) -> Path:
    """A rank-4 LoRA in ComfyUI's generic format (diffusion_model.<layer>.lora_up/lora_down) for a FLUX file, strong
    enough to change its output clearly (entries of up @ down have ~2x the weight's spread)."""
    from safetensors import safe_open

    path = Path(path)
    if path.exists():
        return path
    g = torch.Generator().manual_seed(7)
    sd = {}
    with safe_open(str(flux_file), "pt") as f:
        for name in targets:
            w = f.get_tensor(f"{name}.weight").float()
            rank = 4
            s = (2 * w.std() / rank ** 0.5) ** 0.5
            sd[f"diffusion_model.{name}.lora_up.weight"] = (torch.randn(w.shape[0], rank, generator=g) * s).bfloat16()
            sd[f"diffusion_model.{name}.lora_down.weight"] = (torch.randn(rank, w.shape[1], generator=g) * s).bfloat16()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(sd, path)
    return path


def lora_state_dict(model, targets, rank: int = 4, seed: int = 7) -> dict:
    """A rank-`rank` LoRA state dict in ComfyUI's generic format for these Linears of a loaded model (names relative
    to its diffusion model), strong enough to change its output clearly."""
    g = torch.Generator().manual_seed(seed)
    dm, sd = model.model.diffusion_model, {}
    for name in targets:
        w = dm.get_submodule(name).weight.float()
        s = (2 * w.std() / rank ** 0.5) ** 0.5
        sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * s
        sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * s
    return sd


def with_lora(model, sd: dict, strength: float):
    """What LoraLoaderModelOnly returns for this LoRA state dict: ComfyUI's own load_lora_for_models."""
    import comfy.sd

    return comfy.sd.load_lora_for_models(model, None, sd, strength, 0)[0]


def write_flux_controlnet(path: Path, shape=TINY, seed: int = 7) -> Path:
    """A FLUX ControlNet file in the XLabs layout ComfyUI's load_controlnet detects (an image hint, residuals for the
    double blocks), built from ComfyUI's own ControlNetFlux at `shape`'s widths with one double block, random
    weights (its residual Linears too, so that the control changes the image)."""
    import comfy.ldm.flux.controlnet
    import comfy.ops

    cfg = {k: v for k, v in synthetic.unet_config({**shape, "depth": 1, "depth_single_blocks": 0}).items()
           if k != "image_model"}
    net = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                                                   **cfg)
    synthetic.init_random_(net, seed)
    # BFL's key names, as the file's detection reads them (ComfyUI renames *_norm.scale to .weight on load)
    sd = {(k[: -len(".weight")] + ".scale" if k.endswith("_norm.weight") else k): v.contiguous()
          for k, v in net.state_dict().items()}
    save_atomic(sd, Path(path))
    return Path(path)


def comfy_nodes():
    """ComfyUI's own nodes.py (its core nodes: ControlNetApplyAdvanced, ...), imported from the host by its path: the
    name `nodes` also names this repository's package, which may come first on sys.path."""
    import importlib.util
    import sys

    from tools import host

    mod = sys.modules.get("nodes")
    if mod is not None and hasattr(mod, "NODE_CLASS_MAPPINGS"):
        return mod
    spec = importlib.util.spec_from_file_location("nodes", host.comfy_dir() / "nodes.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = mod
    spec.loader.exec_module(mod)
    return mod


def dynamic_patcher(path, with_init=True, dtype=torch.bfloat16):
    """ComfyUI 0.33's dynamic-VRAM patcher (ModelPatcherDynamic, what UNETLoader gives on an NVIDIA GPU by default)
    of this file, on the CPU: the real class, with only the two parts that need a GPU left out (cpu_dynamic_class),
    so that its clones -- a LoRA node's -- are dynamic too, as on a GPU. with_init: the loader's cached_patcher_init
    (UNETLoader's), for ComfyUI's own reload of the file."""
    import comfy.sd

    plain = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype})  # UNETLoader's loader
    dyn = cpu_dynamic_class()(plain.model, plain.load_device, plain.offload_device)
    dyn.cached_patcher_init = plain.cached_patcher_init if with_init else None
    return dyn


_CPU_DYNAMIC = []


def cpu_dynamic_class():
    """ModelPatcherDynamic without its __new__ (which hands a CPU device a plain ModelPatcher), with empty pin records
    in place of comfy-aimdo's host buffers (a native library that needs CUDA), and with partially_unload as 0.33
    computes it where there is no comfy-aimdo page table (its _vbar_get is None on a CPU device: only the backups are
    restored) without its assertion of a GPU load device; every other method is 0.33's. FluxAccel works on such a
    patcher's resident copy, but ComfyUI may still unload the patcher itself: a loaded clone that dies hands its entry
    in ComfyUI's loaded models to its parent (LoadedModel._switch_parent), a LoRA node's dynamic clone."""
    if not _CPU_DYNAMIC:
        import comfy.model_patcher as mp

        def register_load_device(self, device):
            if device not in self.model.dynamic_pins:
                self.model.dynamic_pins[device] = {
                    **{k: (None, [], [-1], [0], [0], {}) for k in ("weights", "patches", "weights-loaded",
                                                                 "patches-loaded")},
                    "hostbufs_initialized": False, "failed": False, "active": False, "current_prompt": False}

        _CPU_DYNAMIC.append(type("CpuModelPatcherDynamic", (mp.ModelPatcherDynamic,), {
            "__new__": lambda cls, *args, **kwargs: object.__new__(cls), "register_load_device": register_load_device,
            "partially_unload": lambda self, device_to, memory_to_free=0, force_patch_weights=False:
            self.restore_loaded_backups()}))
    return _CPU_DYNAMIC[0]
