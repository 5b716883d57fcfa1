"""What a compiled model's files are keyed by (cache/: its kernels and warm-start packages): the versions, the
device, the compile options, and what the compiled blocks' parameters look like on this patcher."""
from __future__ import annotations

import hashlib
import json

import torch

from ..cache.folder import package_version
from ..models import swaps
from ..quant.patch import fp8_state
from . import reductions, single_block


def cache_key(model, cfg, device: torch.device, options: dict) -> str:
    """The key of `model`'s (a ModelPatcher, its patches as they will be loaded) compiled files under the compile
    config `cfg`, whose inductor options are `options`. The live module tree is not hashed: it holds whichever
    clone's patches are applied at the moment."""
    device = torch.device(device)
    dev = "cpu"
    if device.type == "cuda":
        dev = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    dm = model.model.diffusion_model
    # only what changes the compiled artifacts: the inductor options (mode, C++ wrapper), not resolution_policy etc.
    compiled = (repr(sorted(options.items())) + f" {reductions.KEY} {single_block.cache_tag(dm)}"
                + (f" attention={cfg.attention}" if cfg.attention != "cudnn" else "")
                + (" dynamic_tokens" if cfg.dynamic_tokens else ""))
    ident = {"format": 1, "torch": torch.__version__, "triton": package_version("triton"),
             "torchao": package_version("torchao"), "device": dev, "config": compiled, "model": type(dm).__name__,
             "layout": hashlib.sha256(model_layout(model).encode()).hexdigest(), "variant": model_variant(model)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def model_variant(model) -> str:
    """What the compiled blocks depend on beyond the base module's parameters: FluxAccel's FP8 config and the
    modules other object patches swap in at load time (the persistent compile cache is keyed by it)."""
    st = fp8_state(model)
    patched = swaps.items(model)  # by module key, as FluxAccel's block patches swap them (the cache keys stay)
    swapped = sorted(k for k, v in patched if isinstance(v, torch.nn.Module))
    tags = sorted({v.cache_tag for _, v in patched if isinstance(getattr(v, "cache_tag", None), str)})
    return repr((st.config.key() if st else None, swapped, *([tags] if tags else [])))


def model_layout(model) -> str:
    """What the compiled blocks' parameters look like, read from the patcher rather than the live module tree (which
    holds whichever clone's patches are applied at the moment): the architecture ComfyUI detected and the storage and
    compute dtypes. With model_variant it keys the persistent compile cache."""
    bm = model.model
    unet = getattr(getattr(bm, "model_config", None), "unet_config", None) or {}
    return repr((type(bm.diffusion_model).__name__, sorted((k, repr(v)) for k, v in unet.items()),
                 str(bm.get_dtype()), str(getattr(bm, "manual_cast_dtype", None))))
