"""FluxAccel: FP8, per-block torch.compile and a CUDA graph per model call for FLUX in ComfyUI.

ComfyUI loads this folder from custom_nodes/. It exports only the V3 entry point and the web folder;
nothing heavy is imported here, so a missing torchao or an old GPU never breaks ComfyUI's startup.
"""
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import FluxAccelExtension

    return FluxAccelExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
