"""Messages to the editor (web/fluxaccel.js) over ComfyUI's websocket: the Compile node's badge learns which
shapes its model has compiled, and whether CUDA graphs are on, when it happens (during sampling)."""
from __future__ import annotations

import logging

from ..core.upstream import degradations

log = logging.getLogger("fluxaccel.events")

COMPILED = "fluxaccel.compiled"


def _graphs_off(reason: str) -> str:
    """The badge's short form of why CUDA graphs are off ("" when they are not)."""
    if not reason:
        return ""
    if "graph_capture 'call' cannot run" in reason:
        return "graph_capture 'call' cannot run here (the node's text says why)"
    return "cudaMallocAsync: start ComfyUI with --disable-cuda-malloc, or set graph_capture 'call'"


def compiled_state(compiled) -> dict:
    """What the Compile node's badge shows of a compiled model, read from its stats (the websocket message while it
    compiles; the Benchmark's output again, so a badge whose Compile node came from ComfyUI's cache agrees too)."""
    st = compiled.stats
    return {
        "shapes": [k.describe() for k in st.shapes],
        "short": [f"{k.width * k.scale}x{k.height * k.scale} b{k.batch} t{k.text_len}{' +ref' if k.refs else ''}"
                  for k in st.compile_seconds],
        "graphs": compiled.graphs_running,
        "graphs_lost": "; ".join(f"{k.describe()}: {v}" for k, v in st.graphs_lost.items()),
        "graphs_off": _graphs_off(st.graphs_off_reason),
        "compile_seconds": [round(v, 1) for v in st.compile_seconds.values()],
        # shapes compiling in a separate process right now, and the calls that ran uncompiled meanwhile
        "compiling": [k.describe() for k, v in st.separate.items() if v.startswith("compiling")],
        "uncompiled_calls": st.uncompiled_while_compiling,
        # what runs below what was asked (the model's own list, then upstream internals this process lacks): the badge
        # says how many, its tooltip and the Compile node's text what
        "degradations": [d.line() for d in st.degradations] + degradations(),
        "degraded": len(st.degradations) + len(degradations()),
    }


def compiled_notifier(node_id: str | None):
    """A CompiledFlux.on_compiled callback that tells the editor about the Compile node `node_id`."""
    def notify(compiled) -> None:
        if node_id is None:
            return
        try:
            from server import PromptServer

            PromptServer.instance.send_sync(COMPILED, {"node": str(node_id), **compiled_state(compiled)})
        except (ImportError, AttributeError, RuntimeError, OSError, ValueError, TypeError) as e:
            # the editor badge is a nicety: never fail a prompt over it (said, not hidden)
            log.warning("FluxAccel: could not update the Compile node's badge in the editor (%s: %s)",
                        type(e).__name__, e)
    return notify


def progress_text(node_id: str | None):
    """A compile_progress.Report that shows the compile's progress as text on node `node_id` in the editor (ComfyUI's
    progress-text websocket message, to the client that queued the prompt) and in the log every 10 s (the compile's
    end is logged by core/compile.py)."""
    last = [-10.0]

    def report(text: str, seconds: float) -> None:
        if seconds - last[0] >= 10:
            last[0] = seconds
            log.info("FluxAccel: %s", text)
        if node_id is None:
            return
        from server import PromptServer

        PromptServer.instance.send_progress_text(text, str(node_id), PromptServer.instance.client_id)
    return report
