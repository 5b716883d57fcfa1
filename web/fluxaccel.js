// FluxAccel editor extension: shows the report text our nodes return (FP8 summary, benchmark table)
// inline on the node after it runs. Node ids mirror nodes/ids.py (a test checks they agree).
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

export const FLUXACCEL_NODE_IDS = [
  "FluxAccelQuantizeFP8",
  "FluxAccelCompile",
  "FluxAccelWarmup",
  "FluxAccelBenchmark",
  "FluxAccelSyntheticConditioning",
];

app.registerExtension({
  name: "FluxAccel.Report",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!FLUXACCEL_NODE_IDS.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text || []).join("\n");
      if (!text) return;
      let widget = this.widgets?.find((w) => w.name === "fluxaccel_report");
      if (!widget) {
        widget = ComfyWidgets["STRING"](this, "fluxaccel_report", ["STRING", { multiline: true }], app).widget;
        if (widget.inputEl) widget.inputEl.readOnly = true;
        widget.serialize = false;
      }
      widget.value = text;
      this.setDirtyCanvas(true, true);
    };
  },
});
