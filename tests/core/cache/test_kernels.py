"""core/cache/kernels.py: a fresh process reuses the saved artifacts; foreign/corrupt files are ignored
(test_packages.py has the warm-start packages).

Each run is a new Python process with its own empty TORCHINDUCTOR_CACHE_DIR, so a cache hit can only come from
FluxAccel's file."""
import json
import os
import subprocess
import sys
import textwrap

import torch

from conftest import ROOT
from fluxaccel.core.compile.config import CompileConfig
from support.runs import NEW_PROCESS_PRELUDE

SCRIPT = NEW_PROCESS_PRELUDE + textwrap.dedent(r"""
    from fluxaccel.core.cache import packages as warm_start
    warm_start.available = lambda: (False, "this test checks the kernel cache alone")
    with torch.inference_mode():
        c = CompiledFlux(dm, CompileConfig(separate_process=False), Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "kernel-cache-test"))
        out = c(x, t, context=ctx, y=y, guidance=gd)
        ref = dm(x, t, context=ctx, y=y, guidance=gd)
    from fluxaccel.core.bench.metrics import rel_err
    err = rel_err(out, ref)
    print("RESULT", json.dumps({{"loaded": c.stats.cache_loaded, "hits": counters["inductor"]["fxgraph_cache_hit"],
                                "misses": counters["inductor"]["fxgraph_cache_miss"], "err": err}}))
""")


def _run(tmp_path, cache_dir, n):
    env = {**os.environ, "FLUXACCEL_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{n}")}
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1]), p.stderr


def test_fresh_process_hits_the_saved_cache_and_ignores_bad_files(tmp_path, caplog):
    cache = tmp_path / "cache"
    first, _ = _run(tmp_path, cache, 1)
    assert not first["loaded"] and first["misses"] >= 1 and first["hits"] == 0
    files = list(cache.glob("*.bin"))
    assert len(files) == 1
    second, _ = _run(tmp_path, cache, 2)
    assert second["loaded"] and second["hits"] >= 1 and second["misses"] == 0
    assert second["err"] < 2e-2
    # a corrupt and a foreign file under the same key: refused with a warning before anything reaches inductor (the
    # compile that follows a refused load is the first run's, checked above)
    from fluxaccel.core.cache.kernels import KernelCache

    key = files[0].stem
    for blob, says in ((b"FLUXACCEL-COMPILE-CACHE 1\n" + b"{not json", "ignoring unusable compile cache"),
                       (b"\x89PNG something else entirely", "not a FluxAccel compile-cache file"),
                       (b"FLUXACCEL-COMPILE-CACHE 1\n" + b'{"key": "another"}\n' + b"x", "written for another model")):
        files[0].write_bytes(blob)
        caplog.clear()
        c = KernelCache(key, directory=cache)
        assert c.path == files[0] and c.load() is False
        assert says in caplog.text, caplog.text


def test_clear_removes_only_our_files(tmp_path):
    from fluxaccel.core.cache.clear import clear
    from fluxaccel.core.cache.kernels import MAGIC

    (tmp_path / "a.bin").write_bytes(MAGIC + b"{}\n")
    (tmp_path / "b.bin").write_bytes(b"someone else's")
    (tmp_path / "c.txt").write_bytes(MAGIC)
    import torch
    from safetensors.torch import save_file

    from fluxaccel.core.cache import fp8_weights as weights_cache

    weights = tmp_path / "fp8-weights"
    weights_cache._write(weights / "ours.safetensors", {"l.weight": torch.zeros(2, 2)},
                         {"key": weights_cache.json.dumps({"format": weights_cache.FORMAT})})
    save_file({"x": torch.zeros(2)}, str(weights / "theirs.safetensors"))
    (tmp_path / f"{'a' * 32}-{'0' * 16}.compile123.log").write_text("a separate compile process's log")
    (tmp_path / "notes.compile1.log").write_text("someone else's")
    from fluxaccel.core.cache.packages import WarmStart

    WarmStart("a" * 32, tmp_path).save_blocks("0" * 16, ["1" * 16, "2" * 16])  # a block index
    (tmp_path / "other.blocks").write_text("[1, 2]")
    assert clear(tmp_path) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "c.txt", "fp8-weights", "notes.compile1.log",
                                                          "other.blocks"]
    assert [p.name for p in weights.iterdir()] == ["theirs.safetensors"]


def test_fp8_variants_of_one_model_get_their_own_cache_files(cpu_fp8, tiny_flux):
    """The Compile node sees the unpatched module (FP8 object patches apply at load time); the cache key must
    still tell bf16, FP8 per-tensor and FP8 per-row apart, else each compile overwrote the others' file
    (seen on the H200: a per-tensor model 'loaded' the bf16 model's cache)."""
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    models = {"bf16": tiny_flux}
    for gran in ("per_tensor", "per_row"):
        models[gran], _ = apply_fp8(tiny_flux, Fp8Config(gran))
    paths = {name: apply_compile(m, CompileConfig(separate_process=False))[1].cache.path for name, m in models.items()}
    assert len(set(paths.values())) == 3, paths
    again = apply_compile(models["per_row"], CompileConfig(separate_process=False))[1].cache.path
    assert again == paths["per_row"]


def _artifact_keys(path) -> set:
    from torch.compiler._cache import CacheArtifactManager

    from fluxaccel.core.cache.kernels import MAGIC

    payload = path.read_bytes()[len(MAGIC):].partition(b"\n")[2]
    return {(kind, a.key) for kind, items in CacheArtifactManager.deserialize(payload).items() for a in items}


def test_each_file_holds_only_its_own_models_artifacts(cpu_fp8, tiny_flux, tmp_path, monkeypatch):
    """torch keeps one process-wide list of compile artifacts; a file must not carry the other models' (three models
    used to give files of 1x, 2x and 3x the size, and loading one key loaded them all)."""
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from support.runs import denoise_once

    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    fp8, _ = apply_fp8(tiny_flux, Fp8Config("per_tensor"))
    files = []
    for m in (tiny_flux, fp8):
        clone, c = apply_compile(m, CompileConfig(separate_process=False))
        denoise_once(clone)
        files.append(c.cache.path)
    first, second = (_artifact_keys(f) for f in files)
    assert first and second and not (first & second), "the second file repeats the first model's artifacts"


def test_cache_key_does_not_depend_on_which_clone_is_loaded(cpu_fp8, tiny_flux):
    """The key is read from the patcher, not from the live module tree, which holds the FP8 object patches of
    whichever clone ComfyUI loaded last."""
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    cfg = CompileConfig(separate_process=False)
    fp8, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    plain_key, fp8_key = (apply_compile(m, cfg)[1].cache.key for m in (tiny_flux, fp8))
    fp8.patch_model()  # another branch's FP8 clone is what the shared module holds now
    try:
        assert apply_compile(tiny_flux, cfg)[1].cache.key == plain_key
        assert apply_compile(fp8, cfg)[1].cache.key == fp8_key != plain_key
    finally:
        fp8.unpatch_model()


def test_a_restart_that_meets_fewer_shapes_keeps_the_others(tiny_flux, tmp_path, monkeypatch):
    """One compiled model meets two shapes and saves its file; a new one with the same key (a restarted ComfyUI)
    loads the file, compiles only the first shape and saves again: the file still holds both shapes' artifacts."""
    from fluxaccel.core.cache import packages as warm_start
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.compiled import CompiledFlux, Setup
    from support.runs import flux_inputs

    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm_start, "available", lambda: (False, "this test checks the kernel cache alone"))
    dm = tiny_flux.model.diffusion_model
    cfg = CompileConfig(resolution_policy="recompile", separate_process=False)

    def run(c, hw):
        x, t, ctx, y, guidance = flux_inputs(dm, hw=hw)
        c(x, t, context=ctx, y=y, guidance=guidance)

    torch._dynamo.reset()
    first = CompiledFlux(dm, cfg, Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "kernel-cache-restart"))
    run(first, 16), run(first, 24)
    both = _artifact_keys(first.cache.path)
    torch._dynamo.reset()
    again = CompiledFlux(dm, cfg, Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "kernel-cache-restart"))
    assert again.stats.cache_loaded and again.cache.path == first.cache.path
    written = again.cache.path.stat().st_mtime_ns
    run(again, 16)
    assert len(both) > 1 and _artifact_keys(again.cache.path) >= both, "the restart's save dropped a shape"
    # everything this compile needed came from the file: it is not written again on the first call
    assert again.cache.path.stat().st_mtime_ns == written and not again.cache.save()


def test_cache_key_names_the_persistent_reduction_limits(tiny_flux, monkeypatch):
    """Kernels lowered under other persistent-reduction limits (reductions.py) are another file."""
    from fluxaccel.core.compile import reductions
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile

    import weakref

    from fluxaccel.core.compile import patch

    cfg = CompileConfig(separate_process=False)
    before = apply_compile(tiny_flux, cfg)[1].cache.key
    monkeypatch.setattr(reductions, "KEY", "persistent=2048/1024")
    monkeypatch.setattr(patch, "_COMPILED", weakref.WeakKeyDictionary())  # another process: nothing compiled yet
    assert apply_compile(tiny_flux, cfg)[1].cache.key != before
