"""Convert workflows between ComfyUI's API format (POST /prompt) and its editor (UI) format, using the
server's /object_info for input order, widget kinds and output types.

    python tools/workflows.py     # regenerate example_workflows/*.json (UI) from example_workflows/api/*.json,
                                  # and each template's card picture (example_workflows/<name>.jpg)
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


# Layout: a node's column is its depth in the graph (loaders left, Benchmark right), nodes of a column stacked. Sizes
# are generous estimates of what the frontend draws (it enlarges a node that is too small, never shrinks one), so that
# nothing overlaps when a template loads; the Benchmark node is shipped wide and tall enough for its results table's
# key columns and its chart (tests/e2e/test_browser.py loads every template and checks both).
GAP_X, GAP_Y, ROW_H, TITLE_PX_PER_CHAR = 70, 40, 26, 8
BENCHMARK_SIZE = (640, 1060)


def _depths(prompt: dict) -> dict[str, int]:
    depth: dict[str, int] = {}

    def visit(nid: str) -> int:
        if nid not in depth:
            srcs = [v[0] for v in prompt[nid]["inputs"].values()
                    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)]
            depth[nid] = 1 + max((visit(s) for s in srcs), default=-1)
        return depth[nid]

    for nid in prompt:
        visit(nid)
    return depth


def _size(node: dict, info: dict, title: str) -> list[int]:
    if node["class_type"] == "FluxAccelBenchmark":
        return list(BENCHMARK_SIZE)
    inputs = _inputs(info)
    rows = len(inputs) + max(0, len(info["output"]) - 1) + 1
    width = max(330, min(620, TITLE_PX_PER_CHAR * len(title) + 60))
    return [width, 50 + ROW_H * rows + (90 if node["class_type"] == "FluxAccelCompile" else 0)]


def _layout(prompt: dict, object_info: dict) -> dict[str, tuple[list[int], list[int]]]:
    """node id -> (pos, size)."""
    depth = _depths(prompt)
    sizes = {nid: _size(n, object_info[n["class_type"]], n.get("_meta", {}).get("title", n["class_type"]))
             for nid, n in prompt.items()}
    out, x = {}, 40
    for col in range(max(depth.values()) + 1):
        ids = sorted((nid for nid in prompt if depth[nid] == col), key=int)
        y = 60
        for nid in ids:
            out[nid] = ([x, y], sizes[nid])
            y += sizes[nid][1] + GAP_Y
        x += max(sizes[nid][0] for nid in ids) + GAP_X
    return out


def api_to_ui(prompt: dict, object_info: dict) -> dict:
    nodes, links = [], []
    layout = _layout(prompt, object_info)
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
        pos, size = layout[nid]
        nodes.append({"id": int(nid), "type": node["class_type"], "pos": pos, "size": size, "flags": {}, "order": col, "mode": 0, "inputs": ui_inputs,
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


def thumbnail(ui: dict, dest: Path) -> None:
    """The template card's picture: the workflow's nodes as boxes at their positions, titled, with their links."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    nodes = {n["id"]: n for n in ui["nodes"]}
    x0 = min(n["pos"][0] for n in ui["nodes"]) - 30
    y0 = min(n["pos"][1] for n in ui["nodes"]) - 30
    x1 = max(n["pos"][0] + n["size"][0] for n in ui["nodes"]) + 30
    y1 = max(n["pos"][1] + n["size"][1] for n in ui["nodes"]) + 30
    fig = Figure(figsize=(4.0, 3.0), dpi=100, facecolor="#202124")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y1, y0)
    ax.axis("off")
    px_per_unit = 400 / (x1 - x0)
    for _, src, _, dst, _, _ in ui["links"]:
        a, b = nodes[src], nodes[dst]
        ax.plot([a["pos"][0] + a["size"][0], b["pos"][0]], [a["pos"][1] + 20, b["pos"][1] + 20], color="#8ab4f8",
                lw=1.2, zorder=1)
    for n in ui["nodes"]:
        ours = n["type"].startswith("FluxAccel")
        ax.add_patch(FancyBboxPatch((n["pos"][0], n["pos"][1]), n["size"][0], n["size"][1], zorder=2,
                                    boxstyle="round,pad=0,rounding_size=12", lw=1.5,
                                    fc="#1b5e20" if ours else "#3c4043", ec="#81c995" if ours else "#9aa0a6"))
        title = n.get("title", n["type"]).replace(" (FluxAccel)", "")
        fits = max(3, int(n["size"][0] * px_per_unit / 5.2))  # characters of 7-pt text across the box
        ax.text(n["pos"][0] + 10, n["pos"][1] + 12, title if len(title) <= fits else title[:fits - 1] + "…",
                color="white", fontsize=7, zorder=3, va="top", clip_on=True)
    fig.savefig(dest, format="jpg", facecolor=fig.get_facecolor())


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
            thumbnail(ui, dest.with_suffix(".jpg"))
            print("wrote", dest, "and", dest.with_suffix(".jpg").name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
