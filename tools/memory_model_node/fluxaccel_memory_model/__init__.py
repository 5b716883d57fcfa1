"""A ComfyUI custom node of FluxAccel's tools, never of the plugin: loaded only by servers that tools/comfy_server.py
starts with memory_model=True. FluxAccelRandomModelInMemory builds a random-weight FLUX of one of the synthetic
shapes in host memory, for shapes whose weights file does not fit the machine's disk (FLUX.2 [dev]: 64 GB of bf16).

What it changes against UNETLoader: the weights are process memory (anonymous pages), not comfy-aimdo's mapping of a
file; ComfyUI's dynamic VRAM streams them the same way. A reload for a resident model (core's TorchCompileModel,
`clone(disable_dynamic=True)`) cannot read a file: the loader registers one that returns a plain ModelPatcher over the
same tensors (FluxAccel's share_module_tree), so core's rows also hold one host copy of the weights.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the project root, for tools/
from tools.plugin import register  # noqa: E402

register()
from fluxaccel.core.models import resident, synthetic  # noqa: E402

_WEIGHTS: dict[tuple[str, int], dict] = {}  # (shape, seed) -> the random bf16 state dict (built once)
_BUILT: dict[tuple[str, int, str], object] = {}  # (shape, seed, weight_dtype) -> the dynamic patcher over it
# UNETLoader's weight_dtype choices this node reproduces, as the model_options UNETLoader passes
WEIGHT_DTYPES = {"default": {}, "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}}


def _resident_reload(shape: str, seed: int, weight_dtype: str = "default", disable_dynamic: bool = False):
    """cached_patcher_init. bf16: the same weights as a plain ModelPatcher (the tensors shared, nothing copied).
    fp8_e4m3fn_fast: what UNETLoader's reload makes of a bf16 file with that weight_dtype, a model whose weights are
    cast to FP8 (a second host copy, half the size)."""
    import comfy.model_patcher
    import comfy.sd

    if WEIGHT_DTYPES[weight_dtype]:
        return comfy.sd.load_diffusion_model_state_dict(dict(_WEIGHTS[(shape, seed)]), dict(WEIGHT_DTYPES[weight_dtype]),
                                                        disable_dynamic=disable_dynamic)
    dyn = _BUILT[(shape, seed, weight_dtype)]
    copy = resident.shared_copy(dyn)
    if not isinstance(copy, torch.nn.Module):
        raise RuntimeError(f"cannot share the in-memory weights: {copy}")
    return comfy.model_patcher.ModelPatcher(copy, load_device=dyn.load_device, offload_device=dyn.offload_device)


class FluxAccelRandomModelInMemory:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"shape": (sorted(synthetic.SHAPES),), "seed": ("INT", {"default": 0, "min": 0}),
                             "weight_dtype": (sorted(WEIGHT_DTYPES), {"default": "default"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "build"
    CATEGORY = "FluxAccel/tools"

    def build(self, shape: str, seed: int, weight_dtype: str = "default"):
        import comfy.sd

        if (shape, seed) not in _WEIGHTS:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            _WEIGHTS[(shape, seed)] = dict(synthetic.random_state_dict(shape, seed, device))
        sd = _WEIGHTS[(shape, seed)]
        key = (shape, seed, weight_dtype)
        if key not in _BUILT:
            model = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options=dict(WEIGHT_DTYPES[weight_dtype]))
            if model is None:  # ComfyUI's detection did not recognise it: say what it saw
                import comfy.model_detection as md

                raise RuntimeError(f"ComfyUI did not detect {shape}: {len(sd)} keys, e.g. {sorted(sd)[:4]}; prefix "
                                   f"{md.unet_prefix_from_state_dict(sd)!r}; config {md.detect_unet_config(sd, '')}")
            model.cached_patcher_init = (_resident_reload, key)
            _BUILT[key] = model
        return (_BUILT[key],)


NODE_CLASS_MAPPINGS = {"FluxAccelRandomModelInMemory": FluxAccelRandomModelInMemory}
