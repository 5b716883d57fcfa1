"""Ready for the Comfy Registry and ComfyUI-Manager: the registry's own tool (comfy-cli's `comfy node validate`, the
checks `comfy node publish` runs before uploading) accepts the pack, and [tool.comfy] says what it needs."""
import subprocess
import tomllib

from conftest import ROOT

COMFY_CLI = ROOT / ".cache" / "comfy-cli" / "bin" / "comfy"


def test_the_registry_tool_validates_the_pack():
    assert COMFY_CLI.is_file(), "comfy-cli is not installed: run bash scripts/setup.sh"
    p = subprocess.run([str(COMFY_CLI), "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    said = p.stdout + p.stderr
    assert p.returncode == 0 and "All validation checks passed" in said, said[-3000:]


def test_tool_comfy_is_complete():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy = meta["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"] == "FluxAccel" and comfy["Icon"].endswith("web/icon.svg")
    assert comfy["requires-comfyui"] == ">=0.33.0"
    assert (ROOT / "web" / "icon.svg").is_file()
    # what the pack ships: the archive is the git-tracked files minus .comfyignore (tests, benchmark data, CI)
    ignored = (ROOT / ".comfyignore").read_text().split()
    assert {"tests/", "bench/", ".ci/"} <= set(ignored)
    for needed in ("__init__.py", "nodes", "core", "web", "example_workflows", "requirements.txt", "LICENSE"):
        assert (ROOT / needed).exists() and not any(needed.startswith(i.rstrip("/")) for i in ignored), needed
