"""scripts/setup.sh on a fresh clone: ComfyUI is found before anything is installed, so a missing archive is said
in seconds, not after several GB of packages."""
import os
import shutil
import subprocess

from conftest import ROOT


def test_a_missing_comfyui_archive_is_said_before_any_install(tmp_path):
    clone = tmp_path / "clone"
    for part in ("scripts/setup.sh", "tools/host.py", "requirements-dev.txt"):
        (clone / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, clone / part)
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_DIR", "FLUXACCEL_PYTHON")}
    env["FLUXACCEL_COMFYUI_ARCHIVE"] = str(tmp_path / "comfyui-0.33.0.tar.gz")  # not there
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert f"FLUXACCEL_COMFYUI_ARCHIVE={tmp_path / 'comfyui-0.33.0.tar.gz'} is not a file" in p.stderr, p.stderr
    assert not (clone / ".venv").exists() and "installing" not in p.stderr, p.stderr
