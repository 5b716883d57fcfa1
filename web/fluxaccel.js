// FluxAccel editor extension.
//  * Our nodes show the report text they return (FP8 summary, Warmup timings, the Benchmark table) inline.
//  * The Compile node carries a badge: the shapes its model has compiled, whether CUDA graphs are on, and the
//    speedup of the last Benchmark run downstream of it. Shapes arrive over the websocket ("fluxaccel.compiled",
//    sent by nodes/events.py while the sampler compiles), the speedup with the Benchmark node's output.
//  * A prompt refused by the resolution guard (a shape the model was not compiled for) shows a toast naming the
//    compiled and the requested shape.
// Node ids mirror nodes/ids.py (tests/test_web_ids.py checks they agree).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

export const FLUXACCEL_NODE_IDS = [
  "FluxAccelQuantizeFP8",
  "FluxAccelCompile",
  "FluxAccelWarmup",
  "FluxAccelBenchmark",
  "FluxAccelSyntheticConditioning",
];
const COMPILE = "FluxAccelCompile";
const BENCHMARK = "FluxAccelBenchmark";
const SHAPE_ERROR = "is compiled for"; // core/compile.py's strict-shape error: "...compiled for X, but received Y"

const badges = new Map(); // Compile node id (string) -> {shapes, graphs, speedup}
window.__fluxaccel = { badges, toasts: [] }; // read by the browser test

function badgeText(b) {
  const parts = [b.shapes?.length ? b.shapes.join(", ") : "compiles on first use"];
  if (b.graphs !== undefined) {
    parts.push(b.graphs ? "CUDA graphs on" : b.graphsOff ? `CUDA graphs off (${b.graphsOff})`
      : b.graphsLost ? "CUDA graphs lost (re-record limit)" : "CUDA graphs off");
  }
  if (b.speedup) parts.push(`${b.speedup.toFixed(2)}x vs eager`);
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

api.addEventListener("fluxaccel.compiled", ({ detail }) => {
  updateBadge(detail.node, { shapes: detail.short, graphs: detail.graphs, graphsOff: detail.graphs_off,
                             graphsLost: detail.graphs_lost });
});

api.addEventListener("execution_error", ({ detail }) => {
  const msg = detail?.exception_message || "";
  if (msg.includes(SHAPE_ERROR)) toast("FluxAccel: not a compiled shape", msg.trim());
});

function showReport(node, text) {
  let widget = node.widgets?.find((w) => w.name === "fluxaccel_report");
  if (!widget) {
    widget = ComfyWidgets["STRING"](node, "fluxaccel_report", ["STRING", { multiline: true }], app).widget;
    if (widget.inputEl) widget.inputEl.readOnly = true;
    widget.serialize = false;
  }
  widget.value = text;
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

app.registerExtension({
  name: "FluxAccel.Editor",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!FLUXACCEL_NODE_IDS.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text || []).join("\n");
      if (text) showReport(this, text);
      if (nodeData.name === COMPILE) updateBadge(this.id, {});
      if (nodeData.name === BENCHMARK && message?.fluxaccel_speedup?.length) {
        const compile = upstreamCompile(this);
        if (compile) updateBadge(compile.id, { speedup: Number(message.fluxaccel_speedup[0]) });
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
