"""core/bench/results.py: strict JSON and one set of files per Benchmark run; every committed results JSON is strict."""
import json
import math

from conftest import ROOT
from fluxaccel.core.bench import results


def _strict(name):
    raise ValueError(f"{name} is not JSON")


def test_non_finite_numbers_become_null_with_where_they_were():
    text = results.dumps({"results": [{"sqnr": math.inf, "err": 0.0}, {"sqnr": 21.5, "x": [math.nan]}]})
    data = json.loads(text, parse_constant=_strict)
    assert data["results"] == [{"sqnr": None, "err": 0.0}, {"sqnr": 21.5, "x": [None]}]
    assert [(n["path"], n["was"]) for n in data["nonfinite"]] == [("results[0].sqnr", "inf"), ("results[1].x[0]", "nan")]
    assert "nonfinite" not in json.loads(results.dumps({"a": 1.5}))


def test_a_run_keeps_its_json_table_and_chart_together_and_latest_names_them(tmp_path):
    first = results.save_run(tmp_path, "fp8-per_row/+compile", {"results": [{"v": math.inf}]}, "| table |", b"PNG")
    second = results.save_run(tmp_path, "fp8-per_row/+compile", {"results": []}, "| again |", None)
    assert first["json"].endswith("-fp8-per_row_+compile.json") and first["png"].endswith(".png")
    assert second["json"] != first["json"] and "png" not in second  # same second: numbered, nothing overwritten
    assert (tmp_path / first["md"]).read_text() == "| table |\n" and (tmp_path / first["png"]).read_bytes() == b"PNG"
    saved = json.loads((tmp_path / first["json"]).read_text(), parse_constant=_strict)
    assert saved["files"] == first and saved["results"] == [{"v": None}]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["files"] == second


def test_committed_results_are_strict_json_with_their_command_and_host():
    """The one check of bench/results/: every JSON parses strictly and says how it was made -- the command, the
    ComfyUI version, and (for timed runs) how the server started."""
    files = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text(), parse_constant=_strict)
        assert data["command"].startswith(("python tools/", "bash bench/")), path.name
        assert (data.get("comfyui") or data.get("env", {}).get("comfyui")), path.name
        assert "results" not in data or data.get("start") or "reliability" in path.name, path.name
