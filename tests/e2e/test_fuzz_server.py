"""Hostile prompts against a real ComfyUI server: every FluxAccel node's inputs, as ComfyUI describes them in
/object_info, set to extreme and random values, wrong types, huge text, unknown names, missing inputs and wrong
links, one change per prompt. Whatever the prompt, ComfyUI refuses it at validation or runs it to success or to an
error that names the node and the input, or a user's Cancel ends it where it runs long; afterwards the server
answers, its memory stays bounded, and a normal prompt still samples."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch

from conftest import COMFY_DIR
from tools.comfy_server import ComfyServer, PromptFailed, PromptRejected
from tools.host import CPU_SERVER_ARGS

from .conftest import E2E_UNET, IN_PROMPT, MODELS_DIR, flux_inputs, sample_and_save, saved_latent

pytestmark = pytest.mark.e2e

PROMPTS = 200
SEED = 20261206
DEADLINE_S = 300  # the whole run, server start excluded
PROMPT_S = 20  # a prompt still running after this is cancelled (e.g. a valid 1000-step Benchmark) ...
CANCEL_S = 60  # ... and must then end within this (a compile under way finishes first)
RSS_HEADROOM = 2 * 1024**3  # resident memory may grow by this much over the first normal prompt's, never more
SOCKETS = {"MODEL", "CONDITIONING"}
LOADER = {"class_type": "UNETLoader", "inputs": {"unet_name": E2E_UNET, "weight_dtype": "default"}}
COND = {"class_type": "FluxAccelSyntheticConditioning",
        "inputs": {"model": ["1", 0], "text_length": 16, "guidance": 3.5, "seed": 0}}
COMPILE = {"resolution_policy": "recompile", "max_shapes": 4, "attention": "cudnn", "mode": "default"}
# each node under test (node "9") in a small valid prompt: the node's output into PreviewAny, or the node itself as
# the output; Warmup after a Compile node
BASE = {
    "FluxAccelQuantizeFP8": {"granularity": "per_row", "scope": "blocks"},
    "FluxAccelCompile": COMPILE,
    "FluxAccelParallel": {"gpus": 2},
    "FluxAccelSyntheticConditioning": {"text_length": 16, "guidance": 3.5, "seed": 0},
    "FluxAccelWarmup": {"resolutions": "64x64", "batch_size": 1, "text_length": 16, "cfg": 1.0, "steps": 1},
    "FluxAccelBenchmark": {"positive": ["2", 0], "text_length": 16, "width": 64, "height": 64, "steps": 1, "runs": 1,
                           "seed": 0, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "label": ""},
}
# what a node is called in its messages
NAMES = {"FluxAccelQuantizeFP8": "Quantize FP8", "FluxAccelCompile": "Compile + CUDA Graph",
         "FluxAccelParallel": "Parallel", "FluxAccelSyntheticConditioning": "Synthetic FLUX Conditioning",
         "FluxAccelWarmup": "Warmup", "FluxAccelBenchmark": "Benchmark"}
TEXTS = ["", "x" * 1_000_000, "\x00\ud7ff\u202e", "64x64," * 10_000, "99984x99984", "16384x16384", "0x0", "-64x-64",
         "64x64+99984x64", "1" * 5000 + "x64", "64 x 64; 80x80"]


def base_prompt(node: str) -> dict:
    g = {"1": LOADER, "2": COND}
    upstream = ["1", 0]
    if node == "FluxAccelWarmup":
        g["8"] = {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0], **COMPILE}}
        upstream = ["8", 0]
    g["9"] = {"class_type": node, "inputs": {"model": upstream, **BASE[node]}}
    if node not in ("FluxAccelWarmup", "FluxAccelBenchmark"):
        g["10"] = {"class_type": "PreviewAny", "inputs": {"source": ["9", 0]}}
    return json.loads(json.dumps(g))


def wild_value(rng: random.Random, spec: list):
    """An extreme, random or wrongly typed value for an input of this /object_info spec."""
    kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
    wrong = [None, [], {"x": 1}, True, "seven", 3.7, -(2**63), 2**200]
    if isinstance(kind, list) or kind == "COMBO":
        options = kind if isinstance(kind, list) else opts.get("options", [])
        return rng.choice([rng.choice(options), "", "not-an-option", *wrong])
    if kind == "INT":
        lo, hi = opts.get("min", -(2**63)), opts.get("max", 2**63)
        return rng.choice([lo, hi, lo - 1, hi + 1, rng.randint(lo, hi), str(hi), *wrong])
    if kind == "FLOAT":
        lo, hi = opts.get("min", -1e308), opts.get("max", 1e308)
        return rng.choice([lo, hi, lo - 0.5, hi * 10 + 1, rng.uniform(lo, hi), float("inf"), -1e308, "1.5", *wrong])
    if kind == "STRING":
        return rng.choice([*TEXTS, 12345, None])
    return rng.choice(wrong)  # a socket given a literal


def mutate(rng: random.Random, node: str, spec: dict) -> tuple[dict, str, str]:
    """(prompt, what was changed, the input it concerns)."""
    g = base_prompt(node)
    inputs = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
    name = rng.choice(sorted(inputs))
    how = rng.choice(["value", "value", "value", "unknown", "drop", "link"])
    if how == "unknown":
        name = "fuzz_" + rng.choice(["x", "model2", "resolution", "cuda_graphs"])
        g["9"]["inputs"][name] = rng.choice([1, "on", None, "x" * 100_000])
    elif how == "drop":
        g["9"]["inputs"].pop(name, None)
    elif how == "link":
        g["9"]["inputs"][name] = rng.choice([["2", 0], ["999", 0], ["1", 7], ["9", 0]])
    else:
        g["9"]["inputs"][name] = wild_value(rng, inputs[name])
    return g, how, name


def _run_or_cancel(server: ComfyServer, g: dict) -> str:
    """Run a prompt; one still running after PROMPT_S is cancelled as a user would (ComfyUI's /interrupt for that
    prompt) and must end within CANCEL_S of it. 'ran' or 'cancelled'; ComfyUI's refusals and errors are raised."""
    pid = server.queue(g)
    try:
        server.wait(pid, timeout=PROMPT_S, poll=0.02)
        return "ran"
    except TimeoutError:
        server.post("/interrupt", {"prompt_id": pid})
    try:
        server.wait(pid, timeout=CANCEL_S, poll=0.02)
        return "ran"  # it ended before the cancel reached it
    except PromptFailed as e:
        if any(m[0] == "execution_interrupted" for m in e.messages):
            return "cancelled"
        raise


def _normal(server: ComfyServer, seed: int) -> None:
    g = {**flux_inputs(), **sample_and_save("1", seed=seed, steps=1, tag="fuzz-normal")}
    assert torch.isfinite(saved_latent(server, server.wait(server.queue(g), timeout=120, poll=0.02))).all()


@pytest.fixture(scope="module")
def fuzz_server(e2e_model_file, tmp_path_factory):
    srv = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("fuzz"), MODELS_DIR, CPU_SERVER_ARGS, cpu_fp8=True,
                      env=IN_PROMPT).start()
    yield srv
    srv.stop()


def test_two_hundred_hostile_prompts_leave_the_server_working(fuzz_server):
    server, rng = fuzz_server, random.Random(SEED)
    info = server.get("/object_info")
    nodes = sorted(BASE)
    assert all(n in info for n in nodes)
    _normal(server, seed=0)
    rss0 = server.memory_bytes()["RssAnon"]
    t0, seen = time.monotonic(), {"rejected": 0, "ran": 0, "failed": 0}
    for i in range(PROMPTS):
        node = nodes[i % len(nodes)]
        g, how, name = mutate(rng, node, info[node])
        what = f"prompt {i}: {node}.{name} ({how}) = {str(g['9']['inputs'].get(name))[:80]!r}"
        try:
            outcome = _run_or_cancel(server, g)
            seen[outcome] = seen.get(outcome, 0) + 1
        except PromptRejected as e:  # ComfyUI's validation: the node and the input are named
            seen["rejected"] += 1
            errors, body = e.body.get("node_errors", {}), json.dumps(e.body)[:1500]
            named = {err.get("extra_info", {}).get("input_name") for err in errors.get("9", {}).get("errors", [])}
            if how == "link":  # a link ComfyUI cannot follow may be reported where it leads (its linked_node)
                linked = [err.get("extra_info", {}).get("linked_node") for v in errors.values() for err in v["errors"]]
                assert "9" in errors or any(link and link[0] == "9" for link in linked), f"{what}: {body}"
            else:
                assert name in named, f"{what}: {body}"
        except PromptFailed as e:  # an execution error: raised by the node under test, naming it and the input
            seen["failed"] += 1
            err = next(m[1] for m in e.messages if m[0] == "execution_error")
            assert err["node_id"] == "9" and err["exception_type"] == "fluxaccel.FluxAccelError", f"{what}: {err}"
            msg = err["exception_message"]
            assert NAMES[node] in msg and name in msg, f"{what}: {msg[:1500]}"
        assert server.get("/system_stats", timeout=30)["system"], what
        rss = server.memory_bytes()["RssAnon"]
        assert rss < rss0 + RSS_HEADROOM, f"{what}: RssAnon {rss / 2**30:.2f} GiB, started at {rss0 / 2**30:.2f} GiB"
        _normal(server, seed=i + 1)
        assert time.monotonic() - t0 < DEADLINE_S, f"{what}: the run passed {DEADLINE_S} s ({seen})"
    # every outcome happens: refused at validation, run, and refused by the node itself
    assert min(seen[k] for k in ("rejected", "ran", "failed")) > 0, seen
