"""The plugin as ComfyUI loads it: a real custom-node load, and with torchao import-blocked."""
import subprocess
import sys
import textwrap

from conftest import COMFY_DIR, ROOT

SCRIPT = textwrap.dedent(r"""
    import asyncio, importlib.abc, sys
    BLOCK = {block!r}
    if BLOCK:
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torchao" or name.startswith("torchao."):
                    raise ImportError(f"No module named {{name!r}} (blocked by the test)")
        sys.meta_path.insert(0, Block())
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r}); sys.path.insert(0, {comfy!r})
    from pathlib import Path
    from tools import host
    host.import_comfy(Path({comfy!r}))  # the host under test (this environment has no FLUXACCEL_COMFYUI)
    import nodes, torch
    asyncio.run(nodes.load_custom_node({plugin!r}))
    ours = sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("FluxAccel"))
    print("NODES", ours)
    print("WEB", nodes.EXTENSION_WEB_DIRS)
    print("TORCHAO_LOADED", "torchao" in sys.modules)
    import importlib
    from support.shapes import TINY
    # the plugin as ComfyUI loaded it (under the name it gives the folder), not a second copy
    plugin_name = next(k for k in sys.modules if k.endswith("comfyui-fluxaccel"))
    build_flux = importlib.import_module(plugin_name + ".core.models.synthetic").build_flux
    if not BLOCK:
        from tools.cpu_fp8 import lift_torchao_gate
        lift_torchao_gate()  # CPU FP8 for this test process (the plugin itself never lifts torchao's gate)
    cls = nodes.NODE_CLASS_MAPPINGS["FluxAccelQuantizeFP8"]
    try:
        with torch.inference_mode():
            cls.execute(build_flux(TINY), granularity="per_row", scope="blocks")
        print("EXEC ok")
    except Exception as e:
        print("EXEC", type(e).__name__, e)
    print("COPIES", sorted(k for k in sys.modules if k.split(".")[0] in ("core", "fluxaccel")))
""")


def _run(block: bool) -> str:
    plugin = str(COMFY_DIR / "custom_nodes" / "comfyui-fluxaccel")
    code = SCRIPT.format(block=block, root=str(ROOT), tests=str(ROOT / "tests"), comfy=str(COMFY_DIR),
                         plugin=plugin)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


EXPECTED_NODES = "['FluxAccelBenchmark', 'FluxAccelCompile', 'FluxAccelParallel', 'FluxAccelQuantizeFP8', 'FluxAccelSyntheticConditioning', 'FluxAccelWarmup']"


def test_loads_as_comfyui_custom_node():
    out = _run(block=False)
    assert f"NODES {EXPECTED_NODES}" in out
    assert "comfyui-fluxaccel" in out and "/web" in out.split("WEB", 1)[1].splitlines()[0]
    assert "TORCHAO_LOADED False" in out, "importing the plugin must not import torchao"
    assert "EXEC ok" in out
    assert "COPIES []" in out, "the plugin must be loaded once, under ComfyUI's name for it"


def test_without_torchao_nodes_load_and_explain_on_use():
    out = _run(block=True)
    assert f"NODES {EXPECTED_NODES}" in out
    assert "EXEC FluxAccelError" in out and "needs torchao>=0.17,<0.19, which is not installed" in out
