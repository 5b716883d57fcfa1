"""A real ComfyUI server on 127.0.0.1 with the plugin, and a random-weight FLUX file for its UNETLoader."""
import tempfile
from pathlib import Path

import pytest

from conftest import COMFY_DIR, ROOT
from tools.comfy_server import ComfyServer
from tools.host import CPU_SERVER_ARGS

MODELS_DIR = ROOT / ".cache" / "models"
E2E_UNET = "fluxaccel-random-e2e.safetensors"


@pytest.fixture(scope="session")
def e2e_model_file():
    from core.test_models import write_flux_file

    return write_flux_file(MODELS_DIR / "diffusion_models" / E2E_UNET, "e2e")


@pytest.fixture(scope="session")
def server(e2e_model_file):
    work = Path(tempfile.mkdtemp(prefix="fluxaccel-e2e-"))
    # CPU ComfyUI in bf16, FP8 via torchao's real Float8Tensor path on the CPU (opt-in env, see tests/conftest.py)
    srv = ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, env={"FLUXACCEL_ALLOW_CPU_FP8": "1"})
    srv.start()
    yield srv
    srv.stop()
