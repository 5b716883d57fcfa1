"""The editor extension's node list (web/fluxaccel.js) is the Python node ids (nodes/ids.py)."""
import ast
import re

from conftest import ROOT


def test_web_node_ids_match_python():
    tree = ast.parse((ROOT / "nodes" / "ids.py").read_text())
    py = sorted(n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id != "CATEGORY")
    js_src = (ROOT / "web" / "fluxaccel.js").read_text()
    block = re.search(r"FLUXACCEL_NODE_IDS = \[(.*?)\]", js_src, re.S).group(1)
    assert sorted(re.findall(r'"(\w+)"', block)) == py
    assert all(i.startswith("FluxAccel") for i in py)
