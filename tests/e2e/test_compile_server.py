"""Compile + CUDA Graph inside a real ComfyUI server (CPU inductor): the shape contract as the user meets it,
and correct results again after /free unloads the model."""
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from tools.comfy_server import PromptFailed

from .conftest import flux_inputs, sample_and_save, saved_latent as _latent

pytestmark = pytest.mark.e2e


def _graph(size=64, compile_=True, text_length=16, tag="c", latent_node="EmptySD3LatentImage"):
    g = flux_inputs(size, text_length, latent_node)
    if compile_:
        g["4"] = {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0], "resolution_policy": "strict",
                                                               "max_shapes": 4}}
    g.update(sample_and_save("4" if compile_ else "1", seed=3, steps=2, tag=tag))
    return g


def test_strict_shapes_and_reload_in_a_server(server):
    server.free()
    eager = _latent(server, server.run(_graph(compile_=False, tag="eager")))
    compiled = _latent(server, server.run(_graph(tag="compiled")))
    assert rel_err(compiled, eager) < 2e-2  # bf16, 2 steps, one compile of the e2e FLUX
    for bad, what in (({"size": 80}, "latent 10x10"), ({"text_length": 24}, "24 text tokens")):
        with pytest.raises(PromptFailed) as exc:
            server.run(_graph(tag="bad", **bad))
        msg = exc.value.exception_message
        assert "compiled for batch 1, latent 8x8 (64x64 px), 16 text tokens" in msg and what in msg
        assert "resolution_policy" in msg
    # After /free unloads the model (ComfyUI keeps its node cache, so the Compile node's output, i.e. the same
    # compiled model, is reused), the sampler runs again on the reloaded weights: a different but equivalent
    # empty-latent node forces the KSampler to re-execute with identical inputs.
    server.free(unload_models=True, free_memory=False)
    again = _latent(server, server.run(_graph(tag="again", latent_node="EmptyLatentImage")))
    assert torch.equal(again, compiled)


@pytest.fixture(scope="module")
def own_cache_server(e2e_model_file, tmp_path_factory):
    """A server as the session's, with a compile-cache folder of its own (.cache): a test damages every file in it."""
    from conftest import COMFY_DIR
    from tools.comfy_server import ComfyServer
    from tools.host import CPU_SERVER_ARGS

    from .conftest import IN_PROMPT, MODELS_DIR

    work = tmp_path_factory.mktemp("own-cache-server")
    srv = ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, cpu_fp8=True,
                      env={**IN_PROMPT, "FLUXACCEL_CACHE_DIR": str(work / "compile-cache")})
    srv.cache = work / "compile-cache"
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
def test_damaged_compile_cache_file_warns_and_recompiles(own_cache_server, damage):
    """FluxAccel's persistent compile cache (the server's folder) holds a damaged compile-cache file and damaged
    warm-start packages: the Compile node warns about each file it reads, compiles from scratch (and writes the
    package of each kind of block again), and the result is unchanged."""
    import re
    from pathlib import Path

    server = own_cache_server
    base = _latent(server, server.run(_graph(tag="cache-base")))
    folder = server.cache
    files, packages = list(folder.glob("*.bin")), list(folder.glob("*.warm"))
    assert files and packages, "the compile above must have saved a cache file and a warm-start package"
    for f in files:
        f.write_bytes(b"FLUXACCEL-COMPILE-CACHE 1\n{broken" if damage == "corrupt" else b"\x89PNG\r\n\x1a\n....")
    for f in packages:
        f.write_bytes(b"FLUXACCEL-WARM-START 1\n{broken" if damage == "corrupt" else b"\x89PNG\r\n\x1a\n....")
    at = server.log_path.stat().st_size
    g = _graph(tag=f"cache-{damage}")
    g["4"]["inputs"]["max_shapes"] = 3 if damage == "corrupt" else 2  # a new Compile node output: loads the cache
    again = _latent(server, server.run(g))
    log = server.log_path.read_bytes()[at:].decode(errors="replace")
    # every package of the model is read once -- the shape of this prompt's where it is needed, the others in the
    # background -- and every one refused
    # (the model's compile-cache file and its packages share a name: <key>.bin, <key>-<shape>.warm)
    cache = re.findall(r"ignoring unusable compile cache (\S+) ", log)
    assert len(cache) == 1, log  # the model's one compile-cache file
    ignored = re.findall(r"ignoring unusable warm-start package (\S+) ", log)
    saved = re.findall(r"saved warm-start package (\S+) ", log)
    mine = {str(p) for p in packages if p.name.startswith(Path(cache[0]).stem + "-")}
    assert len(saved) == 2, log  # a new package per kind of block (double, single)
    # (a package written again by this prompt may be read before or after it is)
    assert len(ignored) == len(set(ignored)) and mine - set(saved) <= set(ignored) <= mine, log
    assert torch.equal(again, base)


@pytest.fixture(scope="module")
def default_server(e2e_model_file, tmp_path_factory):
    """A server as users start it: a new shape compiles in a separate process."""
    from conftest import COMFY_DIR
    from tools.comfy_server import ComfyServer
    from tools.host import CPU_SERVER_ARGS

    from .conftest import MODELS_DIR

    srv = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("default-server"), MODELS_DIR, CPU_SERVER_ARGS)
    srv.start()
    yield srv
    srv.stop()


def test_new_shape_runs_uncompiled_while_a_separate_process_compiles_it(default_server):
    """The Compile node's defaults: the first prompt of a shape no package exists for runs the model uncompiled -- bit
    for bit the uncompiled model's latent -- while a separate process compiles the shape (the log names the process);
    once it is done, the next prompt loads the package it wrote (nothing traced or compiled in the server) and runs
    compiled. A size met later under the same compiled model is no error either: it runs uncompiled, counted, while
    its own compile starts."""
    import time

    server = default_server

    def graph(seed: int, compile_: bool = True, size: int = 48) -> dict:
        g = flux_inputs(size, 12)  # shapes no other test compiles: no package on disk yet
        if compile_:
            g["4"] = {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0],
                                                                   "resolution_policy": "recompile"}}
        g.update(sample_and_save("4" if compile_ else "1", seed=seed, steps=2,
                                 tag=f"separate-{seed}-{compile_}-{size}"))
        return g

    def log_since(at: int) -> str:
        return server.log_path.read_bytes()[at:].decode(errors="replace")

    at = server.log_path.stat().st_size
    first = _latent(server, server.run(graph(1)))
    assert torch.equal(first, _latent(server, server.run(graph(1, compile_=False))))
    assert "in a separate process (pid" in log_since(at), server.log_tail()
    t0 = time.monotonic()
    while "compiled in a separate process in" not in log_since(at):  # said by the server when the process ends
        assert time.monotonic() - t0 < 300 and "separate-process compile of" not in log_since(at), server.log_tail()
        time.sleep(0.5)
    assert "2 model call(s) ran uncompiled meanwhile" in log_since(at)
    at = server.log_path.stat().st_size
    second = _latent(server, server.run(graph(2)))
    said = log_since(at)
    assert "from its warm-start package" in said and "FluxAccel: compiled batch" not in said, said
    at = server.log_path.stat().st_size
    third = _latent(server, server.run(graph(3, size=80)))  # a new size, the same compiled model: no error
    said = log_since(at)
    assert "compiling a new shape batch 1, latent 10x10" in said and "in a separate process (pid" in said, said
    assert rel_err(second, _latent(server, server.run(graph(2, compile_=False)))) < 2e-2
    assert torch.equal(third, _latent(server, server.run(graph(3, compile_=False, size=80))))
