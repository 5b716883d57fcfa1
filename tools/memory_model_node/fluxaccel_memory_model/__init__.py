"""A ComfyUI custom node of FluxAccel's tools, never of the plugin: loaded only by servers that tools/comfy_server.py
starts with memory_model=True. FluxAccelRandomModelInMemory builds a random-weight FLUX of one of the synthetic
shapes in host memory, for shapes whose weights file does not fit the machine's disk (FLUX.2 [dev]: 64 GB of bf16).

What it changes against UNETLoader: the weights are process memory (anonymous pages), not comfy-aimdo's mapping of a
file; ComfyUI's dynamic VRAM streams them the same way. A reload for a resident model (core's TorchCompileModel,
`clone(disable_dynamic=True)`) cannot read a file: the loader registers one that returns a plain ModelPatcher over the
same tensors (FluxAccel's share_tree), so core's rows also hold one host copy of the weights.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the project root, for tools/
from tools.plugin import register  # noqa: E402

register()
from fluxaccel.core.models import resident, synthetic  # noqa: E402

_BUILT: dict[tuple[str, int], object] = {}  # (shape, seed) -> the dynamic patcher built from it


def _resident_reload(shape: str, seed: int, disable_dynamic: bool = False):
    """cached_patcher_init: the same weights as a plain ModelPatcher (the tensors shared, nothing copied)."""
    import comfy.model_patcher

    dyn = _BUILT[(shape, seed)]
    copy = resident._shared_copy(dyn)
    if not isinstance(copy, torch.nn.Module):
        raise RuntimeError(f"cannot share the in-memory weights: {copy}")
    return comfy.model_patcher.ModelPatcher(copy, load_device=dyn.load_device, offload_device=dyn.offload_device)


class FluxAccelRandomModelInMemory:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"shape": (sorted(synthetic.SHAPES),), "seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "build"
    CATEGORY = "FluxAccel/tools"

    def build(self, shape: str, seed: int):
        import comfy.sd

        if (shape, seed) not in _BUILT:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            sd = dict(synthetic.random_state_dict(shape, seed, device))
            model = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={})
            if model is None:  # ComfyUI's detection did not recognise it: say what it saw
                import comfy.model_detection as md

                raise RuntimeError(f"ComfyUI did not detect {shape}: {len(sd)} keys, e.g. {sorted(sd)[:4]}; prefix "
                                   f"{md.unet_prefix_from_state_dict(sd)!r}; config {md.detect_unet_config(sd, '')}")
            model.cached_patcher_init = (_resident_reload, (shape, seed))
            _BUILT[(shape, seed)] = model
        return (_BUILT[(shape, seed)],)


NODE_CLASS_MAPPINGS = {"FluxAccelRandomModelInMemory": FluxAccelRandomModelInMemory}
