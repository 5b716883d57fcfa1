// FluxAccel editor extension.
//  * Our nodes show the report text they return (FP8 summary, Warmup timings) inline; the Benchmark's results are a
//    rendered HTML table (cells from core/bench/benchmark.py table_cells, the best value of each column marked) with a button
//    that copies the same table as markdown.
//  * The Compile node carries a badge: the shapes its model has compiled, whether CUDA graphs are on, and the
//    speedup of the last Benchmark run downstream of it. Shapes arrive over the websocket ("fluxaccel.compiled",
//    sent by nodes/events.py while the sampler compiles), the speedup with the Benchmark node's output.
//  * A prompt refused by the resolution guard (a shape the model was not compiled for) shows a toast naming the
//    compiled and the requested shape.
// Node ids mirror nodes/ids.py (tests/test_web_ids.py checks they agree).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

export const FLUXACCEL_NODE_IDS = [
  "FluxAccelQuantizeFP8",
  "FluxAccelCompile",
  "FluxAccelWarmup",
  "FluxAccelBenchmark",
  "FluxAccelParallel",
  "FluxAccelSyntheticConditioning",
];
const COMPILE = "FluxAccelCompile";
const BENCHMARK = "FluxAccelBenchmark";
const SHAPE_ERROR = "is compiled for"; // core/compile/shapes.py's strict-shape error: "...compiled for X, but received Y"

const badges = new Map(); // Compile node id (string) -> {shapes, graphs, speedup}
window.__fluxaccel = { badges, toasts: [], copied: [] }; // read by the browser test

function badgeText(b) {
  const parts = [b.shapes?.length ? b.shapes.join(", ") : "compiles on first use"];
  if (b.graphs !== undefined) {
    parts.push(b.graphs ? "CUDA graphs on" : b.graphsOff ? `CUDA graphs off (${b.graphsOff})`
      : b.graphsLost ? `CUDA graphs lost (${b.graphsLost})` : "CUDA graphs off");
  }
  if (b.compiling?.length) {
    parts.push(`compiling ${b.compiling.join(", ")} in a separate process: ${b.uncompiledCalls || 0} call(s) ran uncompiled`);
  }
  if (b.speedup) parts.push(`${b.speedup} vs its baseline`); // the Benchmark table's own cell: one rounding
  if (b.degraded) parts.push(`${b.degraded} degraded: ${(b.degradations || []).join("; ") || "see the log"}`);
  return parts.join(" | ");
}

function updateBadge(nodeId, patch) {
  const id = String(nodeId);
  const b = { ...(badges.get(id) || {}), ...patch };
  badges.set(id, b);
  const node = app.graph?.getNodeById(Number(id));
  if (node) {
    node.fluxaccelBadge = badgeText(b);
    node.setDirtyCanvas?.(true, true);
  }
}

function upstreamCompile(node, seen = new Set()) {
  // follow MODEL inputs upwards until a Compile node (Benchmark <- Warmup <- Compile <- Quantize <- loader)
  if (!node || seen.has(node.id)) return null;
  seen.add(node.id);
  if (node.type === COMPILE) return node;
  const slot = node.inputs?.findIndex((i) => i.name === "model") ?? -1;
  return slot < 0 ? null : upstreamCompile(node.getInputNode(slot), seen);
}

function toast(summary, detail) {
  window.__fluxaccel.toasts.push({ summary, detail });
  app.extensionManager?.toast?.add({ severity: "error", summary, detail, life: 15000 });
}

function compiledPatch(state) {
  return { shapes: state.short, graphs: state.graphs, graphsOff: state.graphs_off, graphsLost: state.graphs_lost,
           degraded: state.degraded, degradations: state.degradations, compiling: state.compiling,
           uncompiledCalls: state.uncompiled_calls };
}

api.addEventListener("fluxaccel.compiled", ({ detail }) => {
  updateBadge(detail.node, compiledPatch(detail));
});

api.addEventListener("execution_error", ({ detail }) => {
  const msg = detail?.exception_message || "";
  if (msg.includes(SHAPE_ERROR)) toast("FluxAccel: not a compiled shape", msg.trim());
});

function showReport(node, text) {
  // a read-only text area in the node (the frontend's DOM-widget API: no internal module imported)
  let widget = node.widgets?.find((w) => w.name === "fluxaccel_report");
  if (!widget) {
    const area = document.createElement("textarea");
    area.readOnly = true;
    area.className = "fluxaccel-report";
    area.style.cssText = "width:100%;height:100%;box-sizing:border-box;resize:none;font:12px/1.35 monospace;" +
      "background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);border:1px solid var(--border-color,#555)";
    widget = node.addDOMWidget("fluxaccel_report", "fluxaccel_report", area, {
      serialize: false, hideOnZoom: false, getMinHeight: () => 60, getValue: () => area.value,
      setValue: (v) => { area.value = v; },
    });
  }
  widget.element.value = text;
  node.setDirtyCanvas(true, true);
}

const TABLE_CSS = `
.fluxaccel-table { font: 12px/1.35 sans-serif; color: var(--input-text, #ddd); overflow: auto; height: 100%;
  box-sizing: border-box; padding: 4px; }
.fluxaccel-table table { border-collapse: collapse; width: 100%; }
.fluxaccel-table caption { text-align: left; padding: 2px 4px 6px; opacity: 0.85; }
.fluxaccel-table th, .fluxaccel-table td { border: 1px solid var(--border-color, #555); padding: 3px 6px;
  text-align: right; white-space: nowrap; }
.fluxaccel-table th { background: var(--comfy-input-bg, #222); font-weight: 600; }
.fluxaccel-table td:first-child, .fluxaccel-table th:first-child { text-align: left; }
.fluxaccel-table td.best { font-weight: 700; background: rgba(46, 160, 67, 0.28); }
.fluxaccel-table button { margin-top: 6px; margin-right: 6px; font: inherit; cursor: pointer; }
.fluxaccel-table:not(.all-columns) .more { display: none; }
.fluxaccel-table .notes { margin: 6px 2px 0; white-space: pre-wrap; opacity: 0.85; }`;

// the columns shown at the node's shipped width: config and the first KEY_COLUMNS of core/bench/benchmark.py's table
// (s/image, speedup vs its baseline, spread); "All columns" shows the rest
const KEY_COLUMNS = 3;

function tableElement(cells, markdown) {
  const root = document.createElement("div");
  root.className = "fluxaccel-table";
  const table = document.createElement("table");
  if (cells.caption) table.createCaption().textContent = cells.caption;
  const head = table.createTHead().insertRow();
  cells.columns.forEach((c, i) => {
    const th = head.appendChild(document.createElement("th"));
    th.textContent = c;
    if (i > KEY_COLUMNS) th.classList.add("more");
  });
  const body = table.createTBody();
  for (const r of cells.rows) {
    const tr = body.insertRow();
    tr.insertCell().textContent = r.config;
    r.cells.forEach((text, i) => {
      const td = tr.insertCell();
      td.textContent = text;
      if (i + 1 > KEY_COLUMNS) td.classList.add("more");
      if (r.best[i]) { td.classList.add("best"); td.title = "best in this column"; }
    });
  }
  const more = document.createElement("button");
  more.className = "fluxaccel-more";
  more.textContent = "All columns";
  more.addEventListener("click", () => {
    const all = root.classList.toggle("all-columns");
    more.textContent = all ? "Key columns" : "All columns";
  });
  const copy = document.createElement("button");
  copy.className = "fluxaccel-copy";
  copy.textContent = "Copy as markdown";
  copy.addEventListener("click", async () => {
    window.__fluxaccel.copied.push(markdown);
    try { await navigator.clipboard.writeText(markdown); copy.textContent = "Copied"; }
    catch { copy.textContent = "Copy failed: select the table instead"; }
    setTimeout(() => { copy.textContent = "Copy as markdown"; }, 2000);
  });
  const notes = document.createElement("div");
  notes.className = "notes";
  notes.textContent = (cells.notes || []).join("\n");
  root.append(table, more, copy, notes);
  return root;
}

function showTable(node, cells, markdown) {
  if (!document.getElementById("fluxaccel-table-css")) {
    const style = document.head.appendChild(document.createElement("style"));
    style.id = "fluxaccel-table-css";
    style.textContent = TABLE_CSS;
  }
  const el = tableElement(cells, markdown);
  let widget = node.widgets?.find((w) => w.name === "fluxaccel_table");
  if (widget) {
    widget.element.replaceChildren(...el.childNodes);
  } else {
    // a fixed height (the table's rows): the rest of the node stays for the chart preview below it
    const noteLines = (cells.notes || []).reduce((n, t) => n + Math.ceil(t.length / 85), 0);
    const height = () => 110 + 26 * (cells.rows.length + 1) + 17 * noteLines;
    widget = node.addDOMWidget("fluxaccel_table", "fluxaccel_table", el, {
      serialize: false, hideOnZoom: false, getMinHeight: height, getMaxHeight: height, getHeight: height,
    });
  }
  node.setDirtyCanvas(true, true);
}

// The Compile node's badge is one of the frontend's node badges (node.badges, drawn above the title next to the
// frontend's own): an entry is a function returning {height, getWidth(ctx), draw(ctx, x, y)}, as the frontend's
// LGraphBadge has (both pinned frontends, 1.32 and 1.49, draw node.badges this way).
function fluxaccelBadge(node) {
  const text = node.fluxaccelBadge || "";
  return {
    fluxaccel: true,
    text,
    height: text ? 20 : 0,
    getWidth(ctx) {
      if (!text) return 0;
      ctx.save();
      ctx.font = "bold 12px sans-serif";
      const w = ctx.measureText(text).width + 16;
      ctx.restore();
      return w;
    },
    draw(ctx, x, y) {
      if (!text || node.flags?.collapsed) return;
      const w = this.getWidth(ctx);
      ctx.save();
      ctx.font = "bold 12px sans-serif";
      ctx.fillStyle = "#1b5e20";
      ctx.beginPath();
      ctx.roundRect ? ctx.roundRect(x, y, w, this.height, 6) : ctx.rect(x, y, w, this.height);
      ctx.fill();
      ctx.fillStyle = "#ffffff";
      ctx.fillText(text, x + 8, y + 14);
      ctx.restore();
    },
  };
}

// Widget values of workflows saved with inputs a node no longer has. The editor assigns saved values by position,
// so they are mapped by name here (the server says the same of API prompts in its log). Compile's older forms start
// with cuda_graphs (a boolean; today's first widget is resolution_policy, a name): [cuda_graphs, mode,
// resolution_policy, max_shapes, persistent_cache, ...], attention seventh where that slot holds a name (the form
// with clear_cache sixth holds a boolean there). Quantize FP8 kept granularity and scope first, Warmup its first five.
const COMPILE_DEFAULT_ATTENTION = "cudnn";
const KEPT_PREFIX = { FluxAccelQuantizeFP8: 2, FluxAccelWarmup: 5 };

export function migrateWidgets(nodeType, values) {
  if (!Array.isArray(values)) return values;
  if (nodeType === COMPILE) {
    if (typeof values[0] !== "boolean" || values.length < 4) return values;
    const attention = typeof values[6] === "string" ? values[6] : COMPILE_DEFAULT_ATTENTION;
    return [values[2], values[3], attention, values[1]]; // resolution_policy, max_shapes, attention, mode
  }
  const kept = KEPT_PREFIX[nodeType];
  return kept !== undefined && values.length > kept ? values.slice(0, kept) : values;
}

app.registerExtension({
  name: "FluxAccel.Editor",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!FLUXACCEL_NODE_IDS.includes(nodeData.name)) return;
    const configure = nodeType.prototype.configure;
    nodeType.prototype.configure = function (info) {
      const values = migrateWidgets(nodeData.name, info?.widgets_values);
      if (values !== info?.widgets_values) {
        console.info(`FluxAccel: ${nodeData.name} was saved with inputs it no longer has; FluxAccel decides them now`);
        info = { ...info, widgets_values: values };
        window.__fluxaccel.migrated = (window.__fluxaccel.migrated || 0) + 1;
      }
      return configure.call(this, info);
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text || []).join("\n");
      if (nodeData.name === BENCHMARK && message?.fluxaccel_table?.length) showTable(this, message.fluxaccel_table[0], text);
      else if (text) showReport(this, text);
      // the node's text and its badge: one state, measured when the node ran (nodes/events.py compiled_state)
      if (nodeData.name === COMPILE) updateBadge(this.id, message?.fluxaccel_compiled?.[0] ? compiledPatch(message.fluxaccel_compiled[0]) : {});
      if (nodeData.name === BENCHMARK && message?.fluxaccel_speedup?.length) {
        const compile = upstreamCompile(this);
        // the compile state measured with the speedup: right also when the Compile node came from ComfyUI's cache
        const state = message.fluxaccel_compiled?.[0];
        if (compile) updateBadge(compile.id, { ...(state ? compiledPatch(state) : {}), speedup: message.fluxaccel_speedup[0] });
      }
    };
  },
  nodeCreated(node) {
    if (node.comfyClass === COMPILE || node.type === COMPILE) {
      node.badges = node.badges || [];
      node.badges.push(() => fluxaccelBadge(node));
    }
  },
});
