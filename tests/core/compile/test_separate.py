"""core/compile/separate.py on the CPU: a real ComfyUI FLUX (FP8 Linears) compiled in a separate Python process
while this one runs it uncompiled; the package it writes is loaded here, nothing traced here."""
import logging
import weakref

import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile import patch as compile_patch, separate
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.cache.packages import WarmStart
from fluxaccel.core.patches import describe
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from fluxaccel.core.upstream import Unavailable
from support.runs import clear_compile_counters, compiled_graphs
from support.runs import denoise_once


@pytest.fixture
def fp8_model(cpu_fp8, tiny_flux):
    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    return q


def _uncompiled(model):
    from fluxaccel.core.compile.patch import remove_compile

    return denoise_once(remove_compile(model))


@pytest.mark.fresh_compile
def test_blocks_compile_in_a_separate_process_while_the_model_runs_uncompiled(fp8_model, tmp_path, monkeypatch,
                                                                              caplog):
    """The separate process runs the model's call once, compiling each block kind into its package, and writes the
    call's index of them; this process runs uncompiled meanwhile (counted: stats, badge), Warmup's and the
    Benchmark's calls wait for it, then both packages load (nothing traced here); a restart finds the index and loads
    them at its first call, with no process started."""
    from fluxaccel.nodes.events import compiled_state

    caplog.set_level(logging.INFO, logger="fluxaccel")
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path / "cache"))
    clear_compile_counters()
    cfg = CompileConfig(separate_process=True)
    model, compiled = apply_compile(fp8_model, cfg)
    assert compiled.separate is not None and not compiled.stats.degradations
    first = denoise_once(model)
    assert torch.equal(first, _uncompiled(model)) and compiled.stats.uncompiled_while_compiling == 1
    assert compiled_graphs() == 0 and not compiled.stats.compile_seconds  # nothing compiled in this process
    (said,) = describe(model)["compile"]["separate_process"].values()
    assert said.startswith("compiling in a separate process (pid")
    badge = compiled_state(compiled)
    assert badge["compiling"] == [job_key(compiled).describe()] and badge["uncompiled_calls"] == 1
    progress = []
    compiled.on_progress = lambda text, seconds: progress.append(text)
    with compiled.compiling_here():
        second = denoise_once(model)
    (job,) = compiled.separate.jobs.values()
    assert job.state == "ready", job.why
    assert progress and progress[0].startswith("waiting for the separate-process compile")
    assert compiled_graphs() == 2 and list(compiled.stats.warm_start.values()) == ["loaded"]  # both kinds loaded
    assert "compiled in a separate process in" in compiled.stats.separate[job_key(compiled)]
    assert "1 model call(s) ran uncompiled meanwhile" in caplog.text and compiled_state(compiled)["compiling"] == []
    assert rel_err(second, first) < 2e-2
    store = compiled.packages.store
    (index,) = store.dir.glob("*.blocks")
    assert len(store.signatures()) == 2 and store.blocks_on_disk(index.name[len(store.key) + 1:-len(".blocks")])
    # the same as the blocks compiled in this process (its own cache folder)
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path / "in-process"))
    here, c2 = apply_compile(fp8_model, CompileConfig(separate_process=False))
    assert torch.equal(second, denoise_once(here)) and list(c2.stats.warm_start.values()) == ["saved"]
    # a restart: the index is found, no process starts, the packages load in the first call
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_patch, "_COMPILED", weakref.WeakKeyDictionary())  # nothing compiled in this process
    clear_compile_counters()
    restarted, c3 = apply_compile(fp8_model, cfg)
    assert torch.equal(denoise_once(restarted), second)
    assert not c3.separate.jobs and c3.stats.eager_calls == 0 and list(c3.stats.warm_start.values()) == ["loaded"]
    assert compiled_graphs() == 2


def job_key(compiled):
    (key,) = compiled.stats.shapes
    return key


def test_warmup_and_benchmark_compile_here(fp8_model):
    """compiling_here (Warmup, Benchmark): no separate process; the call compiles (or loads) in this process."""
    model, compiled = apply_compile(fp8_model, CompileConfig(separate_process=True))
    with compiled.compiling_here():
        denoise_once(model)
    assert not compiled.separate.jobs and compiled.stats.eager_calls == 0 and len(compiled.stats.compile_seconds) == 1


@pytest.mark.fresh_compile
def test_without_comfyui_launch_flags_the_shape_compiles_here_and_says_why(fp8_model, monkeypatch, caplog):
    from fluxaccel.core.upstream import comfy_internals

    monkeypatch.setattr(comfy_internals, "launch_args", lambda: Unavailable("ComfyUI", "0.x", "comfy.cli_args.args"))
    model, compiled = apply_compile(fp8_model, CompileConfig(separate_process=True))
    denoise_once(model)
    assert compiled.stats.eager_calls == 0 and len(compiled.stats.compile_seconds) == 1
    (d,) = compiled.stats.degradations
    assert d.what.startswith("compile in a separate process (batch 1") and "comfy.cli_args.args" in d.why
    assert d.line() in describe(model)["degradations"]
    assert "compiles in this process, not in a separate one" in caplog.text


def test_without_warm_start_packages_it_is_refused_at_once(fp8_model, monkeypatch):
    """A torch that cannot save compiled blocks (no AOT compile): no package carries a separate compile back, so a
    new shape compiles in its first call, and that is said."""
    from fluxaccel.core.cache import packages as warm_start

    monkeypatch.setattr(warm_start, "available", lambda: (False, "torch 2.8 has no aot_compile"))
    _, compiled = apply_compile(fp8_model, CompileConfig(separate_process=True))
    assert compiled.separate is None
    assert any(d.what == "compile in a separate process" and "torch 2.8 has no aot_compile" in d.why
               for d in compiled.stats.degradations)


def test_a_process_that_fails_is_said_with_its_log(fp8_model, tmp_path, monkeypatch):
    """The process's exit status and its log's last line make the job's reason; the model then compiles here."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nprint('no GPU left for me')\nsys.exit(3)\n")
    monkeypatch.setattr(separate, "WORKER", worker)
    model, compiled = apply_compile(fp8_model, CompileConfig(separate_process=True))
    seps = separate.SeparateCompiles(WarmStart("k" * 32, tmp_path), compiled.cfg, torch.device("cpu"), {})
    x = torch.zeros(1, 16, 2, 2)

    class Key:
        def describe(self):
            return "the test shape"

    job = seps.start(Key(), "0" * 16, torch.nn.Linear(2, 2), (x,), {"transformer_options": {}})
    assert job.state == "running"
    assert job.wait() == "failed"
    assert job.why == "the process exited with status 3: no GPU left for me"
    assert job.describe() == "compiled in this process: the process exited with status 3: no GPU left for me"


def test_room_on_a_gpu_counts_the_weights_once_more(monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 80 * gib))
    assert separate.room(torch.device("cuda:0"), 17 * gib) == ""
    why = separate.room(torch.device("cuda:0"), 19 * gib)
    assert why == "the GPU has 20.0 GiB free and a separate compile needs 21.0 GiB (the weights once more)"
    assert separate.room(torch.device("cpu"), 10**15) == ""
    # a separate compile still running counts in full, whether or not its process has allocated yet
    running = separate.Job("another shape", "0" * 16, "running", nbytes=7 * gib)
    monkeypatch.setattr(separate, "RUNNING", {running})
    assert separate.room(torch.device("cuda:0"), 8 * gib) == ""
    assert separate.room(torch.device("cuda:0"), 10 * gib) == (
        "the GPU has 20.0 GiB free and a separate compile needs 12.0 GiB (the weights once more) beside 9.0 GiB for "
        "the separate compile(s) still running")
    running.state = "ready"
    assert separate.room(torch.device("cuda:0"), 10 * gib) == ""


def test_the_compile_process_checks_fp8_attention_itself(monkeypatch):
    """FP8 attention's check runs in the compile process too: it registers FlashAttention-3's op there (the server's
    registration does not reach another process), and a process that cannot run it says why instead of tracing."""
    from fluxaccel.core.compile import fp8_attention
    from fluxaccel.core.upstream import fa3_internals

    assert separate.why_not_here(CompileConfig(separate_process=False), torch.device("cpu")) == ""
    why = separate.why_not_here(CompileConfig(attention="fp8", separate_process=False), torch.device("cpu"))
    assert why.startswith("attention 'fp8' cannot run in the compile process: it runs on NVIDIA Hopper GPUs only")
    registered = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa3_internals, "available", lambda: registered.append(1) or True)
    assert separate.why_not_here(CompileConfig(attention="fp8", separate_process=False), torch.device("cuda")) == "" and registered == [1]
    assert fp8_attention.why_not(torch.device("cuda")) is None

