"""core/compile/compile_worker.py: the separate compile process lives only as long as the ComfyUI that started it."""
import logging
import os
import subprocess
import sys
import textwrap
import time

import psutil

from conftest import ROOT
from fluxaccel.core.compile import compile_worker

SPAWN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
sys.stdin.read()  # lives until the test closes its stdin
"""

CHILD = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {core!r})
import compile_worker
compile_worker.follow_parent(os.getppid(), Path({folder!r}), interval=0.05)
Path({folder!r}, f"x.tmp{{os.getpid()}}").write_bytes(b"half a package")
Path({folder!r}, "ready").touch()
time.sleep(120)
"""


def _runs(pid: int) -> bool:
    """Whether the process runs (an orphan's zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pid: int, timeout: float) -> bool:
    """Whether the process ended within `timeout` seconds."""
    t0 = time.monotonic()
    while _runs(pid):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.1)
    return True


def _spawn(code: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", SPAWN, code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    return parent, int(parent.stdout.readline())


def test_the_process_runs_while_its_parent_does_and_stops_when_it_is_gone(tmp_path):
    code = CHILD.format(core=str(ROOT / "core" / "compile"), folder=str(tmp_path))
    parent, child = _spawn(code)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "ready").exists():
            assert time.monotonic() - t0 < 60 and psutil.pid_exists(child)
            time.sleep(0.05)
        time.sleep(1.0)  # twenty checks of a parent that runs
        assert _runs(child) and (tmp_path / f"x.tmp{child}").exists()
        parent.stdin.close()
        parent.wait(30)
        assert _gone(child, 30), "the compile process outlived its parent"
        assert not (tmp_path / f"x.tmp{child}").exists()  # its half-written file removed
    finally:
        if psutil.pid_exists(child):
            psutil.Process(child).kill()


def test_a_real_separate_compile_stops_when_comfyui_exits(tmp_path):
    """A ComfyUI process starts a separate compile of a real FLUX and exits at once: the compile process says why it
    stops and ends, leaving no package and no temporary file behind."""
    parent_code = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
        from tools.plugin import register
        register()
        from tools import host
        host.import_comfy(host.comfy_dir())
        from support.models import build_flux
        from support.runs import denoise_once
        from fluxaccel.core.compile.config import CompileConfig
        from fluxaccel.core.compile.patch import apply_compile
        model, compiled = apply_compile(build_flux("tiny", seed=0), CompileConfig(separate_process=True))
        denoise_once(model)
        (job,) = compiled.separate.jobs.values()
        assert job.state == "running", job.why
        print(job.proc.pid, job.log_path, flush=True)
        os._exit(0)
    """)
    cache = tmp_path / "cache"
    env = {**os.environ, "FLUXACCEL_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", parent_code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    pid, log_path = p.stdout.split()[-2:]
    try:
        assert _gone(int(pid), 60), "the compile process outlived the ComfyUI that started it"
    finally:
        if psutil.pid_exists(int(pid)):
            psutil.Process(int(pid)).kill()
    said = open(log_path, errors="replace").read()
    assert "exited; stopping this compile" in said, said[-3000:]
    assert not list(cache.glob("*.warm")) and not list(cache.glob("*.tmp*")), sorted(cache.iterdir())


def test_posix_watches_the_parent_pid_elsewhere_psutil_or_it_says_it_cannot_tell(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="fluxaccel")
    if os.name == "posix":  # an orphan's parent pid changes the moment its parent exits
        assert compile_worker.parent_alive(os.getppid())() is True
        assert compile_worker.parent_alive(os.getppid() + 1_000_000)() is False
    with monkeypatch.context() as m:  # undone before the fixtures' teardown, which imports ComfyUI (psutil)
        m.setattr(compile_worker.os, "name", "nt")
        assert compile_worker.parent_alive(os.getppid())() is True  # through psutil
        m.setattr(compile_worker, "psutil", None)  # psutil not installed
        assert compile_worker.parent_alive(os.getppid()) is None
        assert compile_worker.follow_parent(os.getppid(), None) is False
    assert "cannot tell whether ComfyUI" in caplog.text and "runs to its end" in caplog.text


def test_a_parent_already_gone_is_seen_as_gone(monkeypatch):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert compile_worker.parent_alive(int(p.stdout))() is False
    monkeypatch.setattr(compile_worker.os, "name", "nt")  # through psutil
    assert compile_worker.parent_alive(int(p.stdout))() is False
