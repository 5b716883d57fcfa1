"""Registry and Manager readiness: the plugin installs into a fresh ComfyUI's custom_nodes/ from a clean clone,
exactly as the README says, and that ComfyUI starts with it; the metadata the registry and the Manager read is
complete, and every node and input explains itself."""
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import COMFY_DIR, ROOT
from tools.comfy_server import ComfyServer
from tools.host import CPU_SERVER_ARGS

from .conftest import MODELS_DIR

pytestmark = pytest.mark.e2e
OURS = {"FluxAccelQuantizeFP8", "FluxAccelCompile", "FluxAccelWarmup", "FluxAccelBenchmark",
        "FluxAccelSyntheticConditioning", "FluxAccelParallel"}
SOCKETS = {"MODEL", "CONDITIONING", "LATENT", "IMAGE"}


def _readme_install_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Install\s+```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_clean_clone_into_a_fresh_comfyui_starts(tmp_path):
    """A ComfyUI of its own, made from the test host's tree without anything a run put there (its models, the
    plugin's link, outputs, the user folder): whatever the test host holds, e.g. after the README's CPU quickstart."""
    comfy = tmp_path / "ComfyUI"
    shutil.copytree(COMFY_DIR, comfy, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "comfyui-fluxaccel", "output", "temp", "user",
                                                  "*.safetensors", "*.db"))
    assert not (comfy / "custom_nodes" / "comfyui-fluxaccel").exists()
    commands = _readme_install_commands()
    assert commands[0] == "cd ComfyUI/custom_nodes" and commands[1].startswith("git clone ")
    cwd = tmp_path
    for cmd in commands:  # the README's commands, with this checkout for the repository's URL, ComfyUI's Python
        if cmd.startswith("cd "):
            cwd = cwd / cmd[3:]
            continue
        url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
        cmd = cmd.replace(url, str(ROOT)).replace("python ", f"{sys.executable} ", 1)
        p = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    plugin = comfy / "custom_nodes" / "comfyui-fluxaccel"
    assert (plugin / "__init__.py").is_file() and not (plugin / ".venv").exists()
    # the README's CPU quickstart, its first command (run in the ComfyUI folder): the model its template loads
    quick = re.search(r"\*\*CPU\*\*.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    first = quick.group(1).splitlines()[0].split("#")[0].strip()
    assert first.startswith("python custom_nodes/comfyui-fluxaccel/tools/random_model.py"), first
    p = subprocess.run(first.replace("python ", f"{sys.executable} ", 1), shell=True, cwd=comfy, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    written = comfy / "models" / "diffusion_models" / "fluxaccel-random-e2e.safetensors"
    assert written.stat().st_size > 5e6 and "wrote" in p.stderr, p.stderr[-2000:]  # the 256-wide e2e shape, ~10 MB
    # tools/clear_cache.py, run as installed, clears this ComfyUI's cache (not the plugin's own test host)
    cache = comfy / "user" / "fluxaccel" / "compile-cache"
    cache.mkdir(parents=True)
    from fluxaccel.core.cache.kernels import MAGIC

    (cache / "x.bin").write_bytes(MAGIC + b"{}\n")
    (cache / "notes.bin").write_bytes(b"not ours")
    env = {k: v for k, v in os.environ.items() if k not in ("FLUXACCEL_CACHE_DIR", "COMFYUI_DIR")}
    p = subprocess.run([sys.executable, "custom_nodes/comfyui-fluxaccel/tools/clear_cache.py"], cwd=comfy, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"removed 1 cache file(s) from {cache}" in p.stdout, p.stdout + p.stderr
    assert sorted(f.name for f in cache.iterdir()) == ["notes.bin"]
    quickstart = json.loads((plugin / "example_workflows" / "api" / "fluxaccel_quickstart_cpu.json").read_text())
    assert quickstart["1"]["inputs"]["unet_name"] == written.name
    with ComfyServer(comfy, tmp_path / "work", MODELS_DIR, CPU_SERVER_ARGS) as srv:
        info = srv.get("/object_info")
        assert OURS <= set(info)
        assert b"registerExtension" in srv.get("/extensions/comfyui-fluxaccel/fluxaccel.js")
        assert "comfyui-fluxaccel" in srv.get("/workflow_templates")
        log = srv.log_path.read_text(errors="replace")
    ours = [line for line in log.splitlines() if "comfyui-fluxaccel" in line]
    assert ours and not [line for line in ours if "IMPORT FAILED" in line], ours


def test_registry_metadata_and_self_describing_nodes(server):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, comfy = meta["project"], meta["tool"]["comfy"]
    assert project["name"] == "comfyui-fluxaccel" and re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["description"] and project["license"]["text"] == "GPL-3.0-or-later"
    assert project["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"] == "FluxAccel" and comfy["Icon"].endswith("icon.svg")
    assert (ROOT / "web" / "icon.svg").is_file()
    assert "GNU GENERAL PUBLIC LICENSE" in (ROOT / "LICENSE").read_text() and "Version 3" in (ROOT / "LICENSE").read_text()
    reqs = (ROOT / "requirements.txt").read_text().split()
    assert reqs == project["dependencies"] and reqs[0].startswith("torchao>=") and reqs[1].startswith("matplotlib")
    info = server.get("/object_info")
    for name in OURS:
        node = info[name]
        assert node["category"].startswith("FluxAccel") and len(node["description"]) > 40, name
        for group in ("required", "optional"):
            for inp, spec in node["input"].get(group, {}).items():
                opts = spec[1] if len(spec) > 1 else {}
                assert opts.get("tooltip"), f"{name}.{inp} has no tooltip"
        assert node["output_tooltips"] and all(node["output_tooltips"]), f"{name}: an output has no tooltip"
    # as plain as ComfyUI's own nodes: the Benchmark shows at most 4 widgets, the rest are advanced
    bench = info["FluxAccelBenchmark"]["input"]["required"]
    shown = [k for k, spec in bench.items() if spec[0] not in SOCKETS and not (spec[1] if len(spec) > 1 else {}).get("advanced")]
    assert len(shown) <= 4, shown
    # one default for the synthetic text length, so a Warmup at its defaults covers a Benchmark at its defaults
    lengths = {n: info[n]["input"]["required"]["text_length"][1]["default"]
               for n in ("FluxAccelWarmup", "FluxAccelBenchmark", "FluxAccelSyntheticConditioning")}
    assert len(set(lengths.values())) == 1, lengths
    warm = info["FluxAccelWarmup"]["input"]["required"]
    assert warm["resolutions"][1]["default"] == f"{bench['width'][1]['default']}x{bench['height'][1]['default']}"
    assert warm["cfg"][1]["default"] == bench["cfg"][1]["default"] and warm["batch_size"][1]["default"] == 1


def test_servers_started_here_leave_out_the_cloud_api_nodes(server):
    """The servers that the tests and the headless benchmark start run local workflows only: ComfyUI's cloud API nodes
    are not imported (a large part of every start), while its own local nodes all are."""
    info = server.get("/object_info")
    modules = {node.get("python_module", "") for node in info.values()}
    assert not any(m.startswith("comfy_api_nodes") for m in modules), sorted(modules)
    assert {"KSampler", "UNETLoader", "EmptySD3LatentImage", "SaveLatent", *OURS} <= set(info)
