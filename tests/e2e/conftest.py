"""A real ComfyUI server on 127.0.0.1 with the plugin, and a random-weight FLUX file for its UNETLoader."""
from pathlib import Path

import pytest

from conftest import COMFY_DIR, E2E_UNET, MODELS_DIR
from tools.comfy_server import ComfyServer
from tools.host import CPU_SERVER_ARGS

E2E_3072_UNET = "fluxaccel-random-e2e-3072.safetensors"  # FLUX.1's own width: where memory per clone must show
IN_PROMPT = {"FLUXACCEL_SEPARATE_COMPILE": "0"}


@pytest.fixture(scope="session")
def server(e2e_model_file, tmp_path_factory, session_compile_cache):
    work = tmp_path_factory.mktemp("e2e")
    # CPU ComfyUI in bf16, FP8 via torchao's real Float8Tensor path on the CPU (tools/cpu_fp8.py: a test-only
    # custom node lifts torchao's gate in this server)
    # a new shape compiles in its first call in this server ($FLUXACCEL_SEPARATE_COMPILE=0): the tests check what a
    # compile does; the separate process has its own server (test_compile_server.py)
    # the session's compile cache, named here: a test with a folder of its own may be the one that starts the server
    srv = ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, cpu_fp8=True,
                      env={**IN_PROMPT, "FLUXACCEL_CACHE_DIR": str(session_compile_cache)})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def e2e_3072_model_file():
    from support.models import write_flux_file

    return write_flux_file(MODELS_DIR / "diffusion_models" / E2E_3072_UNET, "e2e-3072")


def flux_inputs(size=64, text_length=16, latent_node="EmptySD3LatentImage", weight_dtype="default",
                unet=E2E_UNET) -> dict:
    """Nodes 1-3 of the test prompts: the e2e FLUX file, synthetic conditioning, an empty latent."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}},
        "2": {"class_type": "FluxAccelSyntheticConditioning",
              "inputs": {"model": ["1", 0], "text_length": text_length, "guidance": 3.5, "seed": 0}},
        "3": {"class_type": latent_node, "inputs": {"width": size, "height": size, "batch_size": 1}},
    }


def sample_and_save(model: str, seed: int, steps: int, tag: str, ksampler: str = "5", save: str = "6",
                    cond: str = "2", latent: str = "3") -> dict:
    """A KSampler on `model` (a node id) with `cond`/`latent` as conditioning/latent, and a SaveLatent of its output."""
    return {
        ksampler: {"class_type": "KSampler", "inputs": {"model": [model, 0], "seed": seed, "steps": steps, "cfg": 1.0,
                                                        "sampler_name": "euler", "scheduler": "simple",
                                                        "positive": [cond, 0], "negative": [cond, 0],
                                                        "latent_image": [latent, 0], "denoise": 1.0}},
        save: {"class_type": "SaveLatent", "inputs": {"samples": [ksampler, 0], "filename_prefix": tag}},
    }


def saved_latent(server, hist, node: str = "6"):
    """The latent a SaveLatent node wrote, read back from the server's output folder."""
    return server.saved_latent(hist, node)
