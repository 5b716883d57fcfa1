"""Convert workflows between ComfyUI's API format (POST /prompt) and its editor (UI) format, using the
server's /object_info for input order, widget kinds and output types.

    python tools/workflows.py     # regenerate example_workflows/*.json (UI) from example_workflows/api/*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _inputs(info: dict) -> list[tuple[str, object, dict]]:
    order = info.get("input_order") or {g: list(info["input"].get(g, {})) for g in ("required", "optional")}
    out = []
    for group in ("required", "optional"):
        for name in order.get(group, []):
            spec = info["input"][group][name]
            typ, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            out.append((name, typ, opts))
    return out


def is_widget(typ, opts) -> bool:
    return (isinstance(typ, list) or typ in WIDGET_TYPES) and not opts.get("forceInput")


def api_to_ui(prompt: dict, object_info: dict) -> dict:
    nodes, links = [], []
    link_id = 0
    incoming: dict[tuple[str, int], list[int]] = {}
    for col, (nid, node) in enumerate(sorted(prompt.items(), key=lambda kv: int(kv[0]))):
        info = object_info[node["class_type"]]
        ui_inputs, widgets = [], []
        for name, typ, opts in _inputs(info):
            value = node["inputs"].get(name)
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                link_id += 1
                src, slot = value
                src_type = object_info[prompt[src]["class_type"]]["output"][slot]
                links.append([link_id, int(src), slot, int(nid), len(ui_inputs), src_type])
                incoming.setdefault((src, slot), []).append(link_id)
                ui_inputs.append({"name": name, "type": src_type, "link": link_id})
            elif is_widget(typ, opts):
                widgets.append(value if value is not None else opts.get("default"))
                if opts.get("control_after_generate"):
                    widgets.append("fixed")
            elif value is None and not is_widget(typ, opts):
                ui_inputs.append({"name": name, "type": typ if isinstance(typ, str) else "COMBO", "link": None})
        nodes.append({"id": int(nid), "type": node["class_type"], "pos": [40 + 340 * (col % 4), 60 + 320 * (col // 4)],
                      "size": [315, 130], "flags": {}, "order": col, "mode": 0, "inputs": ui_inputs,
                      "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
                      "widgets_values": widgets, "title": node.get("_meta", {}).get("title", node["class_type"])})
    for n in nodes:
        info = object_info[n["type"]]
        for slot, typ in enumerate(info["output"]):
            names = info.get("output_name") or info["output"]
            n["outputs"].append({"name": names[slot], "type": typ, "links": incoming.get((str(n["id"]), slot), []),
                                 "slot_index": slot})
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": link_id, "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """The reverse: what the editor's 'queue prompt' sends, for the node types it finds in /object_info."""
    links = {l[0]: l for l in ui["links"]}
    prompt = {}
    for n in ui["nodes"]:
        info = object_info.get(n["type"])
        if info is None:
            raise KeyError(f"node type {n['type']} (node {n['id']}) is not known to this ComfyUI")
        linked = {i["name"]: i["link"] for i in n.get("inputs", []) if i.get("link") is not None}
        values = list(n.get("widgets_values") or [])
        inputs = {}
        for name, typ, opts in _inputs(info):
            if name in linked:
                l = links[linked[name]]
                inputs[name] = [str(l[1]), l[2]]
            elif is_widget(typ, opts):
                if not values:
                    raise ValueError(f"node {n['id']} ({n['type']}): no widget value for input {name!r}")
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate"):
                    values.pop(0)
        if values:
            raise ValueError(f"node {n['id']} ({n['type']}): {len(values)} widget values left over: {values}")
        prompt[str(n["id"])] = {"class_type": n["type"], "inputs": inputs, "_meta": {"title": n.get("title", n["type"])}}
    return prompt


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import tempfile

    from tools import host
    from tools.comfy_server import ComfyServer

    cdir = host.ensure_host()
    with tempfile.TemporaryDirectory() as work, ComfyServer(cdir, Path(work), ROOT / ".cache" / "models",
                                                            host.CPU_SERVER_ARGS) as srv:
        info = srv.get("/object_info")
        for api in sorted((ROOT / "example_workflows" / "api").glob("*.json")):
            ui = api_to_ui(json.loads(api.read_text()), info)
            dest = ROOT / "example_workflows" / api.name
            dest.write_text(json.dumps(ui, indent=1) + "\n")
            print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
