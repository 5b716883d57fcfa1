"""The editor in a real browser: Debian's headless Chromium, driven by playwright-core (npm), against a real
ComfyUI server on 127.0.0.1 serving the real frontend. Our nodes are found by the node search under FluxAccel, the
quickstart example workflow loads from the plugin's templates and runs on the tiny model, the Compile node's
badge and the Benchmark table render, and a wrong resolution shows a toast naming both shapes. Screenshots go to
the test's temporary folder, or to $FLUXACCEL_ARTIFACTS/browser/. Set-up: scripts/setup-browser.sh (run by
scripts/test.sh; Chromium is installed only as root, else the test is skipped with the command to run)."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

from .conftest import E2E_UNET

pytestmark = pytest.mark.e2e

BROWSER_DIR = ROOT / "tests" / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def test_editor_in_a_real_browser(server, tmp_path):
    # the screenshots: in this test's folder, or where FLUXACCEL_ARTIFACTS says (docs/editor.png is
    # editor-after-run.png of such a run)
    artifacts = Path(os.environ.get("FLUXACCEL_ARTIFACTS") or tmp_path) / "browser"
    node = shutil.which("node")
    missing = [what for what, ok in (("node", node), ("chromium", os.path.exists(CHROMIUM)),
                                      ("playwright-core", (BROWSER_DIR / "node_modules" / "playwright-core").is_dir()))
               if not ok]
    if missing and os.geteuid() != 0:  # setup-browser.sh installs Chromium only as root
        pytest.skip(f"missing {missing}: run sudo apt-get install chromium fonts-dejavu-core, then "
                    f"bash scripts/setup-browser.sh")
    assert not missing, f"missing {missing}: run bash scripts/setup-browser.sh"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COMFY_URL": server.url, "E2E_UNET": E2E_UNET, "ARTIFACTS": str(artifacts),
           "CHROMIUM": CHROMIUM}
    p = subprocess.run([node, str(BROWSER_DIR / "editor_test.mjs")], cwd=BROWSER_DIR, env=env, capture_output=True,
                       text=True, timeout=1500)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    r = json.loads(line[len("RESULT "):])
    (artifacts / "result.json").write_text(json.dumps(r, indent=1))  # what the page showed, for a failing run
    assert "error" not in r, r.get("error", "") + "\n" + p.stderr[-2000:]
    ours = {"FluxAccelQuantizeFP8", "FluxAccelCompile", "FluxAccelWarmup", "FluxAccelBenchmark"}
    assert {k for k, cat in r["categories"].items() if cat == "FluxAccel"} >= ours
    found = "\n".join(r["searchResults"])
    for title in ("Quantize FP8 (FluxAccel)", "Compile + CUDA Graph (FluxAccel)", "Warmup (FluxAccel)",
                  "Benchmark (FluxAccel)"):
        assert title in found, (f"{title!r} not in the node search results: {r['searchResults']}; "
                               f"open dialogs: {r.get('openDialogs')}; log: {p.stderr[-1500:]}")
    templates = sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json"))
    assert len(templates) == 7 and all(t in r["templateCards"] for t in templates), r["templateCards"]
    # every card has its own picture where the frontend asks for it (getTemplateThumbnailUrl: the template's name
    # with its mediaSubtype, jpg for extension templates); templates.png shows the cards
    for t in templates:
        assert server.get(f"/api/workflow_templates/comfyui-fluxaccel/{t}.jpg")[:3] == b"\xff\xd8\xff", t
    # every template loads with no two nodes overlapping, at the sizes the frontend gives them
    assert sorted(r["overlaps"]) == templates and not any(r["overlaps"].values()), r["overlaps"]
    old = r["oldCompile"]  # workflows saved with Compile's former widgets: mapped by name, the rest left to FluxAccel
    assert old["twelve"] == {"resolution_policy": "recompile", "max_shapes": 3, "attention": "fp8",
                             "mode": "tuned-kernels"}, old
    assert old["seven"] == {"resolution_policy": "recompile", "max_shapes": 2, "attention": "cudnn",
                            "mode": "default"}, old
    assert old["migrated"] == 2, old
    shipped = r["shippedCompile"]  # today's four widgets load as saved
    assert shipped["migrated"] == 0 and list(shipped["widgets"]) == ["resolution_policy", "max_shapes", "attention",
                                                                      "mode"], shipped
    assert set(r["loadedTypes"]) >= (ours - {"FluxAccelQuantizeFP8"}) | {"UNETLoader"}
    w = r["benchmarkWidgets"]  # widget values land on the right widgets (seed's control_after_generate included)
    assert (w["cfg"], w["sampler_name"], w["scheduler"], w["steps"]) == (1.0, "euler", "simple", 2), w
    t = r["table"]  # the Benchmark's results rendered as an HTML table in the node
    assert t["visible"] and t["headings"][:5] == ["config", "s/image (median)", "speedup vs its baseline",
                                                  "spread s (runs)", "baseline s/image"], t
    # at the shipped node size, without resizing: config and the key columns inside the node, the rest one click away
    assert t["shownHeadings"] == ["config", "s/image (median)", "speedup vs its baseline", "spread s (runs)"], t
    assert t["shownInside"], t
    assert "highlighted" in t["notes"] and "spread" in t["notes"], t
    configs = [row[0] for row in t["rows"]]
    assert len(configs) == 2 and configs[0].startswith("eager-") and configs[1].endswith("+compile"), t
    assert all(len(row) == len(t["headings"]) for row in t["rows"]) and t["best"], t
    speedup = t["rows"][1][2]
    base, own = float(t["rows"][1][4]), float(t["rows"][1][1])  # cells rounded to 3 decimals: bound the ratio's error
    tol = (base / own) * (0.0005 / base + 0.0005 / own) + 0.005
    assert float(speedup.rstrip("x")) == pytest.approx(base / own, abs=tol), t
    assert t["caption"].startswith("FLUX 64x64, 2 euler steps"), t
    assert r["copied"].startswith("FLUX 64x64") and f"| {configs[1]} |" in r["copied"], r["copied"]
    badge = r["badge"] or ""
    assert "64x64 b1 t16" in badge and "CUDA graphs off (this model runs on the CPU" in badge, badge
    assert f"{speedup} vs its baseline" in badge, badge
    assert "no CUDA graphs: this model runs on the CPU" in r["compileText"], r["compileText"]  # the same state
    toast = r["toasts"][0]["detail"]
    assert "compiled for batch 1, latent 8x8 (64x64 px)" in toast and "latent 10x10 (80x80 px)" in toast, toast
    assert any("compiled for" in t for t in r["toastDom"]), r["toastDom"]
    assert not [e for e in r["consoleErrors"] if "fluxaccel" in e.lower()], r["consoleErrors"]
    # the screenshot after the run shows the shipped template, and no tab of another workflow (the editor's own
    # empty "Unsaved Workflow" aside)
    assert r["openTabs"] is not None and "fluxaccel_quickstart_cpu" in r["openTabs"], r["openTabs"]
    assert set(r["openTabs"]) <= {"fluxaccel_quickstart_cpu", "Unsaved Workflow"}, r["openTabs"]
    for shot in ("templates.png", "node-search.png", "editor-after-run.png", "editor-toast.png"):
        assert (artifacts / shot).stat().st_size > 10_000
