"""Two FLUX shapes compiled in one ComfyUI server: a dev-like model (guidance embedding) at 64x64 and a
schnell-like one (none) at 80x80. Both give the eager result, and running one never recompiles the other:
dynamo's own recompile log (TORCH_LOGS=recompiles, in the server log) stays silent once both are compiled."""
import re
from pathlib import Path

import pytest

from conftest import COMFY_DIR
from fluxaccel.core.bench.metrics import rel_err
from tools.comfy_server import ComfyServer
from tools.host import CPU_SERVER_ARGS

from .conftest import E2E_UNET, IN_PROMPT, MODELS_DIR, sample_and_save, saved_latent

pytestmark = pytest.mark.e2e

SCHNELL_UNET = "fluxaccel-random-e2e-schnell.safetensors"


@pytest.fixture(scope="module")
def logged_server(e2e_model_file, tmp_path_factory):
    from support.models import write_flux_file

    write_flux_file(MODELS_DIR / "diffusion_models" / SCHNELL_UNET, "e2e-schnell")
    work = tmp_path_factory.mktemp("2shapes")
    srv = ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, env={"TORCH_LOGS": "recompiles", **IN_PROMPT}).start()
    yield srv
    srv.stop()


def _branches(prefix: str, unet: str, size: int, seed: int) -> dict:
    """One model, compiled and eager, sampled at its own size: nodes <prefix>1..<prefix>9."""
    n = lambda i: f"{prefix}{i}"  # noqa: E731
    g = {
        n(1): {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        n(2): {"class_type": "FluxAccelSyntheticConditioning",
               "inputs": {"model": [n(1), 0], "text_length": 16, "guidance": 3.5, "seed": 0}},
        n(3): {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        n(4): {"class_type": "FluxAccelCompile", "inputs": {"model": [n(1), 0], "resolution_policy": "strict",
                                                            "max_shapes": 1}},
    }
    for model, k, save in ((n(4), n(5), n(6)), (n(1), n(7), n(8))):
        g.update(sample_and_save(model, seed, 2, f"{prefix}{seed}", ksampler=k, save=save, cond=n(2), latent=n(3)))
    return g


def _counts(server) -> tuple[int, int, int]:
    """Shapes made ready (compiled, or loaded from a warm-start package), dynamo recompiles, packages saved/loaded."""
    log = server.log_path.read_text(errors="replace")
    return (len(re.findall(r"FluxAccel: (?:compiled|loaded) batch ", log)), len(re.findall(r"Recompiling function", log)),
            len(re.findall(r"FluxAccel: (?:saved|loaded) warm-start package", log)))


def test_dev_and_schnell_shapes_in_one_server(logged_server):
    """Each prompt holds both models, compiled and eager (ComfyUI keeps the Compile nodes' outputs between
    prompts of the same graph, as in a user's workflow); only the seed changes."""
    srv = logged_server
    for i, seed in enumerate((1, 2, 3)):
        hist = srv.run({**_branches("10", E2E_UNET, 64, seed), **_branches("20", SCHNELL_UNET, 80, seed)})
        for p in ("10", "20"):
            out, ref = saved_latent(srv, hist, p + "6"), saved_latent(srv, hist, p + "8")
            assert out.shape[-1] == (8 if p == "10" else 10)
            assert rel_err(out, ref) < 2e-2, (p, seed, rel_err(out, ref))
        if i == 0:
            first = _counts(srv)
            assert first[0] == 2, srv.log_tail()
            # the log is live: each model's shape went through a warm-start package (written here, or loaded when an
            # earlier test of this server wrote it); their compiles are not dynamo recompiles of one another
            assert first[2] >= 2, srv.log_tail()
    assert _counts(srv) == first, "a compiled model was compiled again:\n" + srv.log_tail(80)
