"""Probe (GPU): can FluxAccel's compiled FLUX call (inductor, without its cudagraph trees) be captured with a plain
torch.cuda.CUDAGraph under PyTorch's cudaMallocAsync allocator, ComfyUI 0.33's default -- the way core 0.33 captures
its own per-block graphs (comfy/model_prefetch.py)? The probe wraps the compiled call: first call uncaptured,
second captured (thread-local mode), later ones replayed. Each variant runs in its own process (a failed capture
under cudaMallocAsync can abort the process) with the FLUX-width e2e model (1 double + 1 single block), FP8 per-row
plain blocks+modulation, without block regions unless the variant says so, latent 128x128 (1024²), 512 text tokens:

    source .gpu033/setup-on-device.sh; [PROBE_SHAPE=dev PROBE_HW=64 PROBE_TOKENS=256] \
        python3 bench/probes/graph_capture.py --out $OUT [--variants a,b]

Per variant: whether the capture worked, dynamo graphs made during each call, outputs of captured replays vs the
uncaptured compiled call (bit-identical expected), host/device ms per call, and where the capture worked the median
ms per call of replays against uncaptured compiled calls, alternated.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # inductor options over FluxAccel's own, and whether the blocks compile as regions
    "default": ({}, False),
    "no-static-launcher": ({"use_static_cuda_launcher": False}, False),
    "forced-failure": ({}, False),  # a host sync inside the captured call: the capture must fail, the process live on
    # inductor's C++ wrapper launches its Triton kernels with cuLaunchKernel and no pointer check, so graph memory
    # nodes (the buffers a call allocates while captured) may be passed to them
    "cpp-wrapper": ({"cpp_wrapper": True}, False),
    "cpp-wrapper-regions": ({"cpp_wrapper": True}, True),
    # each block compiled on its own (Module.compile: one compile per block kind, reused by every block of it) with
    # the C++ wrapper, the rest of the model eager, the whole call captured
    "blocks-cpp-wrapper": ({"cpp_wrapper": True}, "blocks"),
    # the same with FluxAccel's single-block forward (no concatenation before linear2), as the product's regions run
    "blocks-cpp-wrapper-own-single": ({"cpp_wrapper": True}, "blocks"),
    # the product's default (nested regions, Python wrapper), uncaptured: the reference for the variants above
    "regions-uncaptured": ({}, True),
}


class Capture:
    """The compiled call: uncaptured first, captured into a torch.cuda.CUDAGraph second, replayed after."""

    def __init__(self, fn, sync_inside=False):
        self.fn, self.sync_inside = fn, sync_inside
        self.calls, self.replays, self.graph, self.failed, self.keep = 0, 0, None, None, []
        self.bypass = False  # True: the compiled call uncaptured (the timing reference)

    def __call__(self, x, timestep, **kw):
        import torch

        self.calls += 1
        if self.calls == 1 or self.failed or self.bypass:
            return self.fn(x, timestep, **kw)
        if self.graph is None:
            self.static = (x.clone(), timestep.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                         for k, v in kw.items()})
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    if self.sync_inside:
                        torch.cuda.synchronize()
                    self.out = self.fn(self.static[0], self.static[1], **self.static[2])
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"[:300]
                self.keep.append((e, g))  # freeing the capture's tensors uncaptured aborts the process
                return self.fn(x, timestep, **kw)
            self.graph = g
        else:
            self.static[0].copy_(x)
            self.static[1].copy_(timestep)
            for k, v in kw.items():
                if isinstance(v, torch.Tensor):
                    self.static[2][k].copy_(v)
        self.graph.replay()
        self.replays += 1
        return self.out.clone()


def _own_single_forward(cls) -> None:
    """The single-block class's forward replaced, in this probe process, by FluxAccel's (single_block.py) where a
    block is ready for it, so that Module.compile traces that one."""
    from fluxaccel.core.compile import single_block

    why = single_block.known(cls)
    if why:
        raise RuntimeError(why)
    comfy_forward = cls.forward

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006
        run = single_block.forward if single_block.ready(self) else comfy_forward
        return run(self, x, vec, pe, attn_mask=attn_mask, modulation_dims=modulation_dims,
                   transformer_options=transformer_options)

    cls.forward = forward


def child(variant: str) -> dict:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    import torch

    sys.path.insert(0, str(ROOT))
    from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
    register()
    from tools import host

    host.import_comfy(Path(os.environ["COMFYUI_DIR"]))
    import comfy.model_management as mm
    from torch._dynamo.utils import counters

    import fluxaccel.core.compile.compiled as cc
    from fluxaccel.core.compile import single_block
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    sys.path.insert(0, str(ROOT / "tests"))
    from support.models import build_flux, synthetic_conditioning_for

    extra, regions = VARIANTS[variant]
    shape = os.environ.get("PROBE_SHAPE", "e2e")
    orig = cc.CompileConfig.inductor_options
    if regions != "blocks":
        cc.CompileConfig.inductor_options = lambda self, device: {**orig(self, device), **extra}
    out = {"variant": variant, "shape": shape, "allocator": torch.cuda.get_allocator_backend(),
           "torch": torch.__version__}
    with torch.inference_mode():
        model = build_flux(shape, device="cuda")
        scope = "blocks+modulation" if shape == "e2e" else "blocks"  # e2e: as the first runs of this probe
        q, _ = apply_fp8(model, Fp8Config(granularity="per_row", scope=scope, layout="plain"))
        clone, c = apply_compile(q, CompileConfig(persistent_cache=False, block_regions=regions is True))
        out["graphs_off_reason"] = c.stats.graphs_off_reason
        mm.load_models_gpu([clone])
        if regions == "blocks":  # the whole-model compile replaced by per-block compiles inside the eager model
            dm = clone.model.diffusion_model
            if variant.endswith("own-single"):  # this process only: the class runs FluxAccel's forward where ready
                _own_single_forward(type(dm.single_blocks[0]))
                out["own_single_forward_ready"] = all(single_block.ready(b) for b in dm.single_blocks)
            for blk in (*dm.double_blocks, *dm.single_blocks):
                blk.compile(backend="inductor", dynamic=False, fullgraph=True,
                            options={**orig(c.cfg, torch.device("cuda")), **extra})
            c.runner.compiled = dm
        cap = Capture(c.runner.compiled, sync_inside=variant == "forced-failure")
        cap.bypass = variant == "regions-uncaptured"
        c.runner.compiled = cap
        g = torch.Generator(device="cuda").manual_seed(3)
        hw, tokens = int(os.environ.get("PROBE_HW", "128")), int(os.environ.get("PROBE_TOKENS", "512"))
        out["latent_hw"], out["text_tokens"] = hw, tokens
        x = torch.randn(1, 16, hw, hw, generator=g, device="cuda", dtype=torch.bfloat16)
        ctx, ex = synthetic_conditioning_for(clone.model.diffusion_model, tokens)[0]
        kw = dict(c_crossattn=ctx.cuda(), y=ex["pooled_output"].cuda(), guidance=torch.tensor([3.5], device="cuda"))
        from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers

        bm = clone.model
        wr = get_all_wrappers(WrappersMP.APPLY_MODEL, clone.model_options, is_model_options=True) + \
            clone.get_all_wrappers(WrappersMP.APPLY_MODEL)
        calls = []
        outs = []

        def call():
            return WrapperExecutor.new_class_executor(bm._apply_model, bm, wr).execute(
                x, torch.tensor([0.7], device="cuda"), transformer_options={}, **kw)

        for i in range(6):
            graphs_before = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            try:
                o = call()
                torch.cuda.synchronize()
                outs.append(o.float())
                err = None
            except Exception as e:
                err = f"{type(e).__name__}: {e}"[:400]
            calls.append({"call": i, "seconds": round(time.perf_counter() - t0, 4),
                          "new_dynamo_graphs": counters["stats"]["unique_graphs"] - graphs_before, "error": err})
            if err:
                break
        out["calls"] = calls
        out["capture"] = {"captured": cap.graph is not None, "replays": cap.replays, "failed": cap.failed}
        if len(outs) > 1:
            out["replays_equal_uncaptured"] = [bool(torch.equal(o, outs[0])) for o in outs[1:]]
            out["max_rel_diff_vs_uncaptured"] = max(float((o - outs[0]).norm() / outs[0].norm()) for o in outs[1:])
        if cap.graph is not None or cap.bypass:  # replayed vs uncaptured calls, alternating, ms per call (median of 20)
            import statistics
            ms = {"replayed": [], "uncaptured": []} if cap.graph is not None else {"uncaptured": []}
            for _ in range(20):
                for name, bypass in (("replayed", False), ("uncaptured", True))[-len(ms):]:
                    cap.bypass = bypass
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    call()
                    torch.cuda.synchronize()
                    ms[name].append((time.perf_counter() - t0) * 1e3)
            out["ms_per_call_median"] = {k: round(statistics.median(v), 3) for k, v in ms.items()}
        out.update(c.stats.call_timings())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--out", default=".")
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child)), flush=True)
        return 0
    results = []
    for v in a.variants.split(","):
        try:
            p = subprocess.run([sys.executable, __file__, "--child", v], capture_output=True, text=True,
                               timeout=a.timeout)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            r = json.loads(line[7:]) if line else {"variant": v, "rc": p.returncode,
                                                   "stderr_tail": p.stderr[-2500:]}
            if p.returncode:
                r["rc"] = p.returncode
                r.setdefault("stderr_tail", p.stderr[-2500:])
        except subprocess.TimeoutExpired:
            r = {"variant": v, "timed_out": a.timeout}
        print("PROBE", json.dumps(r), flush=True)
        results.append(r)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    name = "graph-capture" if a.variants == ",".join(VARIANTS) else "graph-capture-" + a.variants.replace(",", "-")
    (Path(a.out) / f"nvidia-h200-probe-{name}.json").write_text(json.dumps(
        {"command": "python3 bench/probes/graph_capture.py " + " ".join(sys.argv[1:]), "results": results},
        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
