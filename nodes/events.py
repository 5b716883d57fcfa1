"""What the editor (web/fluxaccel.js) shows of a compiled model: the Compile node's text and badge, from one state,
and the websocket messages that update the badge when a shape compiles (during sampling)."""
from __future__ import annotations

import logging

from ..core.upstream import degradations

log = logging.getLogger("fluxaccel.events")

COMPILED = "fluxaccel.compiled"


def compiled_state(compiled) -> dict:
    """What the Compile node shows of a compiled model, read from its stats: its text (`text`) and its badge (the
    rest) come from this one dict -- at the node's run, in the websocket message while it compiles, and with the
    Benchmark's output (so a badge whose Compile node came from ComfyUI's cache agrees too)."""
    st = compiled.stats
    lines = [d.line() for d in st.degradations] + degradations()  # what runs below what was asked, then upstream's
    state = {
        "shapes": [k.describe() for k in st.shapes],
        "short": [f"{k.width * k.scale}x{k.height * k.scale} b{k.batch} t{k.text_len}{' +ref' if k.refs else ''}"
                  for k in st.compile_seconds],
        "graphs": compiled.graphs_running,
        "graphs_lost": "; ".join(f"{k.describe()}: {v}" for k, v in st.graphs_lost.items()),
        "graphs_off": compiled.setup.capture_off,
        "compile_seconds": [round(v, 1) for v in st.compile_seconds.values()],
        # shapes compiling in a separate process right now, and the calls that ran uncompiled meanwhile
        "compiling": [k.describe() for k, v in st.separate.items() if v.startswith("compiling")],
        "uncompiled_calls": st.uncompiled_while_compiling,
        "degradations": lines,
        "degraded": len(lines),
    }
    state["text"] = "\n".join([compiled.cfg.summary(compiled.setup.capture_off), *lines])
    return state


def _server():
    """ComfyUI's running PromptServer (a module of the server itself: there is one only inside a running ComfyUI)."""
    from server import PromptServer

    return PromptServer.instance


def compiled_notifier(node_id: str | None):
    """A CompiledFlux.on_compiled callback that tells the editor about the Compile node `node_id`."""
    def notify(compiled) -> None:
        if node_id is None:
            return
        try:
            _server().send_sync(COMPILED, {"node": str(node_id), **compiled_state(compiled)})
        except (ImportError, AttributeError, RuntimeError, OSError, ValueError, TypeError) as e:
            # the editor badge is a nicety: never fail a prompt over it (said, not hidden)
            log.warning("FluxAccel: could not update the Compile node's badge in the editor (%s: %s)",
                        type(e).__name__, e)
    return notify


def progress_text(node_id: str | None):
    """A progress.Report (core/compile/progress.py) that shows the compile's progress as text on node `node_id` in
    the editor (ComfyUI's progress-text websocket message, to the client that queued the prompt) and in the log every
    10 s (the compile's end is logged by core/compile/telemetry.py)."""
    last = [-10.0]

    def report(text: str, seconds: float) -> None:
        if seconds - last[0] >= 10:
            last[0] = seconds
            log.info("FluxAccel: %s", text)
        if node_id is None:
            return
        server = _server()
        server.send_progress_text(text, str(node_id), server.client_id)
    return report
