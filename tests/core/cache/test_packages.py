"""core/cache/packages.py: a new process runs a saved shape without tracing, bit-identical; bad files are refused.

Processes here are new Python interpreters, each with its own empty TORCHINDUCTOR_CACHE_DIR, sharing one FluxAccel
cache folder (as ComfyUI workers of one machine would)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from fluxaccel.core.compile.config import CompileConfig
from support.runs import NEW_PROCESS_PRELUDE

SCRIPT = NEW_PROCESS_PRELUDE + textwrap.dedent(r"""
    from fluxaccel.core.cache import packages as warm_start
    with torch.inference_mode():
        c = CompiledFlux(dm, CompileConfig(separate_process=False), Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "warm-start-test"))
        pending = dict(c.packages.pending)
        c.packages.settle()  # a package on disk is loaded in the background, before the first call
        loaded_before_call = [sum(f.result() is not None for f in pending.values()), warm_start.counts["loaded"]]
        out = c(x, t, context=ctx, y=y, guidance=gd)
        again = c(x, t * 0.5, context=ctx, y=y, guidance=gd)
    torch.save({{"out": out, "again": again}}, {out!r})
    print("RESULT", json.dumps({{"warm_start": list(c.stats.warm_start.values()),
                                "traced_frames": counters["stats"]["unique_graphs"],
                                "calls_captured": counters["stats"]["calls_captured"],
                                "prefetched": [len(pending), *loaded_before_call]}}))
""")


def _start(tmp_path, cache_dir, n, own_inductor_cache=True):
    """Process n; with own_inductor_cache an empty TORCHINDUCTOR_CACHE_DIR of its own (nothing but the package can
    spare it work), else the test session's (its kernels already built by earlier tests: the compile is quicker)."""
    env = {**os.environ, "FLUXACCEL_CACHE_DIR": str(cache_dir)}
    if own_inductor_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / f"inductor{n}")
    script = SCRIPT.format(root=str(ROOT), out=str(tmp_path / f"out{n}.pt"))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _result(p):
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1]), err


def test_two_workers_compile_at_once_then_a_third_starts_warm(tmp_path):
    """Two processes start together on an empty folder: both compile, both write the same package (temporary name,
    rename), both outputs are right. A third process, with an empty inductor cache of its own, then loads it: no
    dynamo trace at all (counters), the same outputs bit for bit as the process that compiled it."""
    cache = tmp_path / "cache"
    a, b = _start(tmp_path, cache, 1, own_inductor_cache=False), _start(tmp_path, cache, 2, own_inductor_cache=False)
    (ra, _), (rb, _) = _result(a), _result(b)
    for r in (ra, rb):
        assert r["warm_start"] == ["saved"] and r["traced_frames"] == 2, r  # one trace per block kind
    files = list(cache.glob("*.warm"))
    assert len(files) == 2 and not list(cache.glob("*.tmp*")), sorted(p.name for p in cache.iterdir())
    rc, log = _result(_start(tmp_path, cache, 3))
    # the third loads it in the background when the compiled model is made (before its first call, which then counts
    # it as taken into use)
    assert rc == {"warm_start": ["loaded"], "traced_frames": 0, "calls_captured": 0, "prefetched": [2, 2, 0]}, rc
    assert "loading 2 warm-start package(s) in the background" in log and "loaded warm-start package" in log
    first, warm = (torch.load(tmp_path / f"out{n}.pt") for n in (1, 3))
    for k in ("out", "again"):
        assert torch.equal(first[k], warm[k]), k
    two = torch.load(tmp_path / "out2.pt")
    assert torch.equal(first["out"], two["out"])


def _package(tmp_path, key="k" * 32, sig="s" * 16, **meta):
    from fluxaccel.core.cache.packages import MAGIC, WarmStart

    w = WarmStart(key, tmp_path)
    header = {"key": key, "signature": sig, **meta}
    return w, w.path(sig), MAGIC + json.dumps(header).encode() + b"\n"


@pytest.mark.parametrize("case", ["not ours", "foreign key", "other signature", "stale source", "unread source",
                                  "corrupt"])
def test_unusable_packages_are_refused_with_a_warning(tmp_path, caplog, case):
    w, path, head = _package(tmp_path)
    if case == "not ours":
        path.write_bytes(b"\x89PNG something else")
        says = "not a FluxAccel warm-start file"
    elif case == "foreign key":
        path.write_bytes(head.replace(b'"' + b"k" * 32, b'"' + b"x" * 32) + b"payload")
        says = "written for another model"
    elif case == "other signature":
        path.write_bytes(head.replace(b"s" * 16, b"t" * 16) + b"payload")
        says = "written for another model"
    elif case == "stale source":
        from fluxaccel.core.compile import rope  # noqa: F401  (imported: its source can be read)

        _, _, head = _package(tmp_path, sources={"fluxaccel.core.compile.rope": "0" * 64})
        path.write_bytes(head + b"payload")
        says = "stale: the source of fluxaccel.core.compile.rope changed"
    elif case == "unread source":  # a module this process has not imported: whether it changed cannot be told
        _, _, head = _package(tmp_path, sources={"no.such.module": "0" * 64})
        path.write_bytes(head + b"payload")
        says = "cannot tell whether it is stale: the source of no.such.module cannot be read"
    else:
        path.write_bytes(head + b"\x00\x01 not a pickle")
        says = "ignoring unusable warm-start package"
    with caplog.at_level("WARNING", logger="fluxaccel.cache"):
        assert w.load("s" * 16) is None
    assert says in caplog.text and "compiling this shape" in caplog.text, caplog.text


def test_background_load_waits_where_inductor_config_differs(tmp_path, caplog):
    """A package loads in a background thread only where the config torch reads at load time already holds: a patch
    of inductor's config would be seen by every thread. Otherwise it loads at the first call, as it says."""
    import torch._inductor.config as ic

    from fluxaccel.core.cache.packages import Packages

    w, path, head = _package(tmp_path)
    packages = Packages(w, {"triton.cudagraphs": False, "emulate_precision_casts": True})
    assert packages.prefetch(4, torch.device("cpu")) == "no warm-start package on disk for this model"
    path.write_bytes(head + b"payload")
    with ic.patch({"triton.cudagraphs": True}), caplog.at_level("INFO", logger="fluxaccel.cache"):
        said = packages.prefetch(4, torch.device("cpu"))
    assert not packages.pending and "load at the first model call" in said and "triton.cudagraphs" in said
    with caplog.at_level("WARNING", logger="fluxaccel.cache"):  # config as the package needs: loaded in the background
        assert packages.prefetch(4, torch.device("cpu")) == "loading 1 warm-start package(s) in the background"
        packages.settle()
    assert list(packages.pending) == ["s" * 16] and packages.pending["s" * 16].result() is None
    assert "ignoring unusable warm-start package" in caplog.text  # a bad file: warned from the background thread too


def test_background_load_sets_the_wrappers_cpu_isa_for_its_own_duration(tmp_path, monkeypatch):
    """Packages of captured calls (inductor's C++ wrapper for GPU code) load in the background with inductor's
    cpp.vec_isa_ok set as their compile had it (no CPU vector-ISA check, which builds and loads test libraries in new
    processes), and only while the load runs: the process's config is as before afterwards."""
    import torch._inductor.config as ic

    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.cache.packages import Packages

    options = CompileConfig().inductor_options(capture=True)
    assert options["cpp_wrapper"] is True and options["cpp.vec_isa_ok"] is False
    seen = []
    monkeypatch.setattr(torch.compiler, "load_compiled_function",
                        lambda f: seen.append(ic.cpp.vec_isa_ok) or (lambda *a: None))
    w, path, head = _package(tmp_path)
    path.write_bytes(head + b"payload")
    before = ic.cpp.vec_isa_ok
    packages = Packages(w, options)
    assert packages.prefetch(4, torch.device("cpu")) == "loading 1 warm-start package(s) in the background"
    packages.settle()
    assert seen == [False] and packages.pending["s" * 16].result() is not None and ic.cpp.vec_isa_ok == before


def test_block_index_counts_only_where_every_package_it_names_is_there(tmp_path):
    """A whole call's index of per-block packages stands for them only while each is on disk; a
    damaged index or a missing package means the shape compiles again (no index: nothing is claimed)."""
    from fluxaccel.core.compile.blocks import BlockCall

    w, path, head = _package(tmp_path)
    path.write_bytes(head + b"payload")
    assert not w.blocks_on_disk("c" * 16)
    assert w.save_blocks("c" * 16, ["s" * 16]) and w.blocks_on_disk("c" * 16)
    w.blocks_path("c" * 16).write_text("{not json")
    assert not w.blocks_on_disk("c" * 16)
    assert w.save_blocks("c" * 16, ["s" * 16, "t" * 16]) and not w.blocks_on_disk("c" * 16)  # one package missing
    assert BlockCall("c" * 16, "double_block").describe() == f"double_block blocks at call {'c' * 16}"


def test_missing_package_is_silent(tmp_path, caplog):
    w, _, _ = _package(tmp_path)
    with caplog.at_level("WARNING", logger="fluxaccel.cache"):
        assert w.load("s" * 16) is None
    assert not caplog.records


def _module_level_fn(func, *a, **k):
    return func(*a, **k)


def test_signature_tells_calls_apart_and_refuses_what_a_package_cannot_stand_for():
    from fluxaccel.core.cache.packages import NotPackageable, signature

    x = torch.zeros(1, 16, 8, 8, dtype=torch.bfloat16)
    base = signature((x, torch.zeros(1)), {"context": torch.zeros(1, 4, 64), "options": {"attn": _module_level_fn}})
    same = signature((x.clone(), torch.ones(1)), {"context": torch.ones(1, 4, 64), "options": {"attn": _module_level_fn}})
    assert base == same  # values do not matter, only structure
    others = [signature((x.float(), torch.zeros(1)), {"context": torch.zeros(1, 4, 64)}),
              signature((x[:, :, :4], torch.zeros(1)), {"context": torch.zeros(1, 4, 64)}),
              signature((x, torch.zeros(1)), {"context": torch.zeros(1, 5, 64)}),
              signature((x, torch.zeros(1)), {"context": torch.zeros(1, 4, 64), "guidance": None}),
              signature((x, torch.zeros(1)), {"context": torch.zeros(1, 4, 64), "options": {"rope": {"scale": 2.0}}})]
    assert len({base, *others}) == 1 + len(others)
    with torch.enable_grad():  # the autograd mode is part of it (packages are compiled under inference mode)
        g_on = signature((x,), {})
    with torch.inference_mode():
        assert signature((x,), {}) != g_on
    for bad in (lambda f, *a: f(*a), _module_level_fn.__get__(object()), object()):
        with pytest.raises(NotPackageable, match=r"kwargs\.options\.attn"):
            signature((x,), {"options": {"attn": bad}})


def test_source_check_reads_what_torch_saved_without_linecache(monkeypatch):
    """The check of a package's sources digests each module's file as inspect.getsource gives it (what torch saves),
    and never reads linecache: another thread may clear or check it meanwhile (a background load, a traceback), and a
    read losing that race would call an unchanged package stale. Here linecache fails as such a race makes it."""
    import hashlib
    import inspect
    import linecache

    from fluxaccel.core.cache import packages as warm_start
    from fluxaccel.core.compile import rope

    names = ["fluxaccel.core.compile.rope", "torch.nn.functional", "comfy.ldm.flux.model"]
    import comfy.ldm.flux.model  # noqa: F401

    saved = {n: hashlib.sha256(inspect.getsource(sys.modules[n]).encode()).hexdigest() for n in names}

    def lost_race(*a, **k):
        raise KeyError("popped by another thread")

    with monkeypatch.context() as m:  # undone before the asserts: pytest's report of a failure reads linecache
        m.setattr(linecache, "getlines", lost_race)
        m.setattr(linecache, "checkcache", lost_race)
        try:
            same = warm_start._stale_sources(saved)
            one_changed = warm_start._stale_sources({**saved, names[0]: "0" * 64})
        except KeyError as e:
            same = one_changed = f"read linecache: {e!r}"
    assert same == ([], [])
    assert one_changed == ([names[0]], [])
    assert rope.__name__ == names[0]
