"""example_workflows/: the editor (UI) files match the real server's /object_info and their API twins, and the
FP8 benchmark workflow, converted from its UI file as the editor would queue it, runs on the CPU."""
import json

import pytest

from conftest import ROOT
from tools.workflows import ui_to_api

from .conftest import E2E_UNET

pytestmark = pytest.mark.e2e
EXAMPLES = ROOT / "example_workflows"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_ui_workflow_matches_object_info_and_api(server, name):
    info = server.get("/object_info")
    ui = json.loads((EXAMPLES / name).read_text())
    api = ui_to_api(ui, info)  # raises on unknown node types or a widget-count mismatch
    twin = json.loads((EXAMPLES / "api" / name).read_text())
    assert {k: (v["class_type"], v["inputs"]) for k, v in api.items()} == \
        {k: (v["class_type"], v["inputs"]) for k, v in twin.items()}
    assert any(n["type"].startswith("FluxAccel") for n in ui["nodes"])
    for link in ui["links"]:  # every link's type is what its source node outputs
        src = next(n for n in ui["nodes"] if n["id"] == link[1])
        assert info[src["type"]]["output"][link[2]] == link[5]


def test_fp8_benchmark_ui_workflow_runs(server):
    api = ui_to_api(json.loads((EXAMPLES / "fluxaccel_fp8_benchmark.json").read_text()), server.get("/object_info"))
    api["1"]["inputs"]["unet_name"] = E2E_UNET
    api["2"]["inputs"]["text_length"] = 16
    for node in api.values():
        if node["class_type"] == "FluxAccelBenchmark":
            node["inputs"].update(width=64, height=64, steps=1, runs=1, text_length=16)
    hist = server.run(api)
    for node in ("5", "6"):
        assert "| fp8-per_" in hist["outputs"][node]["text"][0]


def test_server_lists_the_ui_workflows_as_templates(server):
    templates = server.get("/workflow_templates")
    assert sorted(templates["comfyui-fluxaccel"]) == sorted(p.stem for p in EXAMPLES.glob("*.json"))
    served = server.get("/api/workflow_templates/comfyui-fluxaccel/fluxaccel_txt2img_dev.json")
    assert served == json.loads((EXAMPLES / "fluxaccel_txt2img_dev.json").read_text())
