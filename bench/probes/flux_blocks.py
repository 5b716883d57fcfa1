"""Probe (GPU): where does a FLUX.1-dev step at 1024^2 / 512 tokens spend its time, and which lead pays?

Times one ComfyUI DoubleStreamBlock and one SingleStreamBlock (FLUX.1-dev width, random bf16 weights) per variant
and estimates a step as 19 x double + 38 x single (the embedders and final layer are ~1 % of the FLOPs); also
times the GEMMs (bf16, FP8 tensorwise, FP8 rowwise) and SDPA backends at the model's shapes, and profiles one
variant's kernels by category. Run on the device:  python3 bench/probes/flux_blocks.py [--out DIR]
Prints one JSON line per measurement ("PROBE {...}") and a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()
T0 = time.time()
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "480"))
RESULTS: list[dict] = []
BLOCKS = (19, 38)  # double, single blocks of the model a step is estimated for (FLUX.1)
DEV = "cuda"
TAG = ""  # a prefix for variant names (the model shape, where not FLUX.1-dev)
OUT_DIR: Path | None = None


def emit(kind: str, **kw):
    rec = {"kind": kind, **kw}
    RESULTS.append(rec)
    print("PROBE", json.dumps(rec), flush=True)
    if OUT_DIR is not None:
        (OUT_DIR / "flux_blocks.json").write_text(json.dumps(RESULTS, indent=1))


def bench_ms(fn, iters=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]


from fluxaccel.core.bench.metrics import rel_err  # noqa: E402


def sdpa_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flop = 4 * 24 * 4608 * 4608 * 128
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                ms = bench_ms(f)
                err = rel_err(f(), ref)
            emit("sdpa", backend=name, ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1), rel_err=err)
        except Exception as e:
            emit("sdpa", backend=name, error=f"{type(e).__name__}: {e}"[:300])


def gemm_shapes(width=3072, mlp=12288, img=4096, txt=512, n_double=19, n_single=38, gated=False):
    """{name: (M, K, N, count per step)} of a FLUX step's block GEMMs (gated: FLUX.2's SiLU-gated MLP, no biases)."""
    first = 2 * mlp if gated else mlp
    return {"dbl.img.qkv": (img, width, 3 * width, n_double), "dbl.img.proj": (img, width, width, n_double),
            "dbl.img.mlp0": (img, width, first, n_double), "dbl.img.mlp2": (img, mlp, width, n_double),
            "dbl.txt.qkv": (txt, width, 3 * width, n_double), "dbl.txt.proj": (txt, width, width, n_double),
            "dbl.txt.mlp0": (txt, width, first, n_double), "dbl.txt.mlp2": (txt, mlp, width, n_double),
            "sgl.linear1": (img + txt, width, 3 * width + first, n_single),
            "sgl.linear2": (img + txt, width + mlp, width, n_single)}


GEMMS = gemm_shapes()
GEMM_CASES = {"dev-1024": GEMMS, "schnell-512": gemm_shapes(img=1024, txt=256),
              "flux2dev-1024": gemm_shapes(6144, 18432, n_double=8, n_single=48, gated=True)}


def gemms(case="dev-1024"):
    f8 = torch.float8_e4m3fn
    tot = {"bf16": 0.0, "fp8_tensor": 0.0, "fp8_row": 0.0}
    flop_step = 0
    for name, (m, k, n, cnt) in GEMM_CASES[case].items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, w8 = a.to(f8), w.to(f8)
        one = torch.ones((), device="cuda")
        sa, sw = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        flop = 2 * m * k * n
        flop_step += flop * cnt
        row = {}
        row["bf16"] = bench_ms(lambda: a @ w.t())
        row["fp8_tensor"] = bench_ms(lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                              use_fast_accum=True))
        row["fp8_row"] = bench_ms(lambda: torch._scaled_mm(a8, w8.t(), sa, sw, out_dtype=torch.bfloat16,
                                                           use_fast_accum=True))
        for key in tot:
            tot[key] += row[key] * cnt
        emit("gemm", case=case, name=name, m=m, k=k, n=n, **{f"{key}_ms": round(v, 4) for key, v in row.items()},
             **{f"{key}_tflops": round(flop / v / 1e9) for key, v in row.items()})
    emit("gemm_step", case=case, tflop=round(flop_step / 1e12, 2), **{f"{k}_ms": round(v, 2) for k, v in tot.items()})


def build_blocks():
    from tools.host import import_comfy

    import_comfy()
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND, SingleStreamBlock

    ops = comfy.ops.disable_weight_init
    torch.manual_seed(0)
    dbl = DoubleStreamBlock(3072, 24, 4.0, qkv_bias=True, dtype=torch.bfloat16, device="cuda", operations=ops)
    sgl = SingleStreamBlock(3072, 24, 4.0, dtype=torch.bfloat16, device="cuda", operations=ops)
    for blk in (dbl, sgl):
        with torch.no_grad():
            for p in blk.parameters():
                p.normal_(0, 0.02)
    emb = EmbedND(dim=128, theta=10000, axes_dim=[16, 56, 56])
    ids = torch.zeros(1, 4608, 3, device="cuda")
    img_ids = torch.stack(torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij"), -1).reshape(-1, 2)
    ids[0, 512:, 1:] = img_ids.to("cuda", torch.float32)
    return dbl, sgl, emb, ids


def build_flux2_blocks():
    """One DoubleStreamBlock and one SingleStreamBlock of FLUX.2 [dev]'s shape (width 6144, 48 heads, SiLU-gated MLP
    of ratio 3, no biases, modulation shared across blocks), with the modulation records the model gives them."""
    from tools.host import import_comfy

    import_comfy()
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND, Modulation, SingleStreamBlock

    ops = comfy.ops.disable_weight_init
    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=DEV, operations=ops)
    dbl = DoubleStreamBlock(6144, 48, 3.0, qkv_bias=False, modulation=False, mlp_silu_act=True, proj_bias=False, **kw)
    sgl = SingleStreamBlock(6144, 48, 3.0, modulation=False, mlp_silu_act=True, bias=False, **kw)
    mods = [Modulation(6144, double=True, bias=False, **kw), Modulation(6144, double=True, bias=False, **kw),
            Modulation(6144, double=False, bias=False, **kw)]
    for m in (dbl, sgl, *mods):
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
    emb = EmbedND(dim=128, theta=2000, axes_dim=[32, 32, 32, 32])
    ids = torch.zeros(1, 4608, 4, device=DEV)
    img_ids = torch.stack(torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij"), -1).reshape(-1, 2)
    ids[0, 512:, 1:3] = img_ids.to(DEV, torch.float32)
    g = torch.Generator(device=DEV).manual_seed(2)
    vec = torch.randn(1, 6144, device=DEV, dtype=torch.bfloat16, generator=g)
    with torch.inference_mode():
        vec_d = (mods[0](vec), mods[1](vec))
        vec_s = mods[2](vec)[0]
    return dbl, sgl, emb, ids, vec_d, vec_s


def fp8_copy(block, granularity, layout="subclass"):
    import copy

    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.linear import quantize_linear

    cfg = Fp8Config(granularity=granularity, layout=layout)
    new = copy.deepcopy(block)
    for name, mod in list(new.named_modules()):
        if isinstance(mod, torch.nn.Linear) and not name.endswith(("mod.lin", "modulation.lin")):
            parent = new.get_submodule(name.rsplit(".", 1)[0]) if "." in name else new
            setattr(parent, name.rsplit(".", 1)[-1], quantize_linear(mod, cfg, "cuda"))
    return new


def cudnn_ctx():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def run_variant(name, dbl, sgl, inputs, *, compile_opts=None, graphs=True, attn=None, ref=None,
                within=contextlib.nullcontext):
    if time.time() - T0 > BUDGET_S:
        emit("variant", name=name, skipped="probe budget spent")
        return None
    img, txt, vec, pe, x, vs = inputs
    ctx = cudnn_ctx if attn == "cudnn" else contextlib.nullcontext
    torch._dynamo.reset()  # the wrappers below share code objects across variants: no cache-limit fallbacks

    def fd(img, txt, vec, pe):
        return dbl(img.clone(), txt.clone(), vec, pe)

    def fs(x, vs, pe):
        return sgl(x.clone(), vs, pe)

    try:
        t0 = time.time()
        if compile_opts is not None:
            opts = dict(compile_opts)
            opts["triton.cudagraphs"] = graphs
            fd = torch.compile(fd, dynamic=False, options=opts)
            fs = torch.compile(fs, dynamic=False, options=opts)

        def call_d():
            if graphs and compile_opts is not None:
                torch.compiler.cudagraph_mark_step_begin()
            return fd(img, txt, vec, pe)

        def call_s():
            if graphs and compile_opts is not None:
                torch.compiler.cudagraph_mark_step_begin()
            return fs(x, vs, pe)

        with ctx(), within(), torch.inference_mode():
            od = [t.clone() for t in call_d()]
            os_ = call_s().clone()
            torch.cuda.synchronize()
            first = time.time() - t0
            d_ms = bench_ms(call_d)
            s_ms = bench_ms(call_s)
        rec = dict(name=name, double_ms=round(d_ms, 4), single_ms=round(s_ms, 4),
                   step_ms_est=round(BLOCKS[0] * d_ms + BLOCKS[1] * s_ms, 2), first_s=round(first, 1))
        if ref is not None:
            rec["rel_err_double_img"] = rel_err(od[0], ref[0][0])
            rec["rel_err_single"] = rel_err(os_, ref[1])
        emit("variant", **rec)
        return od, os_, fd, fs
    except Exception as e:
        emit("variant", name=name, error=f"{type(e).__name__}: {e}"[:500])
        return None


def profile(name, fd, fs, inputs, attn=None):
    from torch.profiler import ProfilerActivity, profile as prof

    img, txt, vec, pe, x, vs = inputs
    ctx = cudnn_ctx if attn == "cudnn" else contextlib.nullcontext
    with ctx(), torch.inference_mode():
        for _ in range(2):
            fd(img, txt, vec, pe), fs(x, vs, pe)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                fd(img, txt, vec, pe)
                fs(x, vs, pe)
            torch.cuda.synchronize()
    cats: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for ev in p.key_averages():
        if not str(getattr(ev, "device_type", "CUDA")).endswith("CUDA"):
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us <= 0:
            continue
        n = ev.key.lower()
        if any(s in n for s in ("gemm", "scaled_mm", "cutlass", "xmma", "nvjet", "sm90_", "cublas")):
            cat = "gemm"
        elif any(s in n for s in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            cat = "attention"
        elif "triton" in n:
            cat = "triton"
        else:
            cat = "other"
        cats[cat] = cats.get(cat, 0.0) + us / 5 / 1000
        kernels[ev.key[:90]] = us / 5 / 1000
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    emit("profile", name=name, ms_per_double_plus_single={k: round(v, 4) for k, v in cats.items()},
         top=[(k, round(v, 4)) for k, v in top])


class _Opts(torch.nn.Module):
    """A block called with FLUX's transformer_options (attention override) and, optionally, plain-torch RoPE (ComfyUI
    0.33 routes RoPE through comfy-kitchen's custom op unless comfy.model_management.in_training is set)."""

    def __init__(self, block, options, torch_rope):
        super().__init__()
        self.block, self.options, self.torch_rope = block, options, torch_rope

    def forward(self, *args, **kwargs):
        import comfy.model_management as mm

        before = mm.in_training
        mm.in_training = self.torch_rope
        try:
            return self.block(*args, transformer_options=dict(self.options), **kwargs)
        finally:
            mm.in_training = before


def host_diff(dbl, sgl, inputs, base, ref):
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    for name, options, torch_rope in (("host attention", {}, False),
                                      ("fluxaccel cudnn-first attention", {OVERRIDE_KEY: sdpa_cudnn_first}, False),
                                      ("cudnn-first + torch rope", {OVERRIDE_KEY: sdpa_cudnn_first}, True)):
        wd, ws = _Opts(d, options, torch_rope), _Opts(s_, options, torch_rope)
        run_variant(f"fp8 row plain compile+graphs, {name}", wd, ws, inputs, compile_opts=base, ref=ref)
        nog = run_variant(f"fp8 row plain compile, {name} (no graphs, for profile)", wd, ws, inputs,
                          compile_opts=base, graphs=False, ref=ref)
        if nog:
            profile(f"fp8 row plain compile, {name}", nog[2], nog[3], inputs)


class StaticScale:
    """Lever probe: FP8 activation scales fixed ahead of the call (calibrated per Linear on eager inputs, per
    tensor), instead of each call's row-wise absmax: the quantization becomes a pointwise cast that can fuse into its
    producer without a reduction. Patches the plain layout's forward for the probe's blocks only."""

    def __init__(self, *blocks):
        from fluxaccel.core.quant.linear import is_fp8_linear

        self.linears = [m for b in blocks for m in b.modules() if is_fp8_linear(m)]

    def calibrate(self, run, margin: float = 1.0):
        hooks = [m.register_forward_pre_hook(self._observe) for m in self.linears]
        try:
            run()
        finally:
            for h in hooks:
                h.remove()
        for m in self.linears:
            m.static_act_scale = (m.observed_amax * margin / 448.0).clamp(min=1e-12).float()

    @staticmethod
    def _observe(mod, args):
        amax = args[0].detach().abs().amax().float()
        prev = getattr(mod, "observed_amax", None)
        mod.observed_amax = amax if prev is None else torch.maximum(prev, amax)

    @contextlib.contextmanager
    def on(self):
        from fluxaccel.core.quant import fp8

        def forward(mod, x, *args, **kwargs):
            ao = fp8.float8_ops()
            kw = mod.fp8_act_kwargs
            x_scale = mod.static_act_scale.expand(*x.shape[:-1], 1).contiguous()
            x_data = ao.quantize(x, x_scale, kw.float8_dtype)
            a, b = ao.preprocess_data(x_data.reshape(-1, x_data.shape[-1]), mod.weight.t(), mod.fp8_mm_config)
            out = ao.addmm(a, ao.preprocess_scale(x_scale, x.shape), b, mod.fp8_weight_scale.t(), output_dtype=x.dtype,
                           bias=mod.bias, use_fast_accum=mod.fp8_mm_config.use_fast_accum)
            return out.reshape(*x.shape[:-1], mod.weight.shape[0])

        classes = {type(m) for m in self.linears}
        saved = {c: c.forward for c in classes}
        try:
            for c in classes:
                c.forward = forward
            yield
        finally:
            for c, f in saved.items():
                c.forward = f


class Fa3Fp8:
    """Lever probe: FLUX's attention as FlashAttention-3's FP8 kernel (the fa3-fwd wheel), Q, K and V cast to FP8 e4m3
    inside the compiled block, so that inductor fuses each cast into the kernel that makes the tensor (QK-norm and
    RoPE for Q and K). Scales per tensor: `bound` takes Q's and K's from the block's QK-norm weights (an RMS-normed
    vector's element is at most sqrt(head_dim) x its weight, and RoPE rotates pairs, which keeps that bound: no
    reduction, no overflow); else each call's absmax (a reduction before the cast). V's scale is each call's absmax."""

    def __init__(self, block, bound: bool):
        import fa3_fwd_interface  # noqa: F401  (registers torch.ops.fa3_fwd)

        self.qk = None
        if bound:
            norms = [m for m in block.modules() if type(m).__name__ == "QKNorm"]
            w = lambda n: (getattr(n, "weight", None) if getattr(n, "weight", None) is not None else n.scale)  # noqa: E731
            hd = w(norms[0].query_norm).numel()  # the norm's width is the head dim
            qmax = max(float(w(n.query_norm).detach().abs().max()) for n in norms)
            kmax = max(float(w(n.key_norm).detach().abs().max()) for n in norms)
            dev = next(block.parameters()).device
            # 1 % over the bound: rounding in the norm and RoPE must not push an element past FP8's largest (448)
            self.qk = tuple(torch.tensor(hd ** 0.5 * m * 1.01 / 448.0, device=dev, dtype=torch.float32)
                            for m in (qmax, kmax))

    @staticmethod
    def _absmax_scale(t):
        return (t.abs().amax().float() / 448.0).clamp(min=1e-12)

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        f8 = torch.float8_e4m3fn
        b, h, n, d = q.shape
        qs, ks = self.qk if self.qk is not None else (self._absmax_scale(q), self._absmax_scale(k))
        vs = self._absmax_scale(v)
        q8, k8, v8 = ((t.float() / sc).to(f8).transpose(1, 2) for t, sc in ((q, qs), (k, ks), (v, vs)))
        desc = [sc.reshape(1, 1).expand(b, h) for sc in (qs, ks, vs)]
        out = torch.ops.fa3_fwd._flash_attn_forward(q8, k8, v8, q_descale=desc[0], k_descale=desc[1],
                                                    v_descale=desc[2], softmax_scale=d ** -0.5)[0]
        return out.reshape(b, n, h * d)


def fp8_attention(dbl, sgl, inputs, base, ref):
    """FP8 attention (FlashAttention-3) against the default's cuDNN bf16 SDPA, at block level, with the error."""
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    try:
        import fa3_fwd_interface  # noqa: F401
    except Exception as e:  # noqa: BLE001
        emit("variant", name="fa3 fp8 attention", error=f"fa3_fwd_interface not importable: {type(e).__name__}: {e}"[:300])
        return
    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    wd, ws = _Opts(d, {OVERRIDE_KEY: sdpa_cudnn_first}, True), _Opts(s_, {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    cur = run_variant(f"{TAG}default: fp8 row plain compile", wd, ws, inputs, compile_opts=base, graphs=False, ref=ref)
    for bound in (False, True):
        name = f"{TAG}fa3 fp8 attention, q/k scales {'from the QK-norm bound' if bound else 'absmax per call'}"
        wd8 = _Opts(d, {OVERRIDE_KEY: Fa3Fp8(d, bound)}, True)
        ws8 = _Opts(s_, {OVERRIDE_KEY: Fa3Fp8(s_, bound)}, True)
        r = run_variant(name, wd8, ws8, inputs, compile_opts=base, graphs=False, ref=ref)
        if r and bound:
            profile(name, r[2], r[3], inputs)
    static = StaticScale(d, s_)  # with the static activation scales of the block-level levers: the fastest blocks
    img, txt, vec, pe, x, vs = inputs
    with torch.inference_mode():
        static.calibrate(lambda: (wd(img.clone(), txt.clone(), vec, pe), ws(x.clone(), vs, pe)))
    with static.on():
        run_variant(f"{TAG}static per-tensor activation scales", wd, ws, inputs, compile_opts=base, graphs=False,
                    ref=ref)
        r = run_variant(f"{TAG}static scales + fa3 fp8 attention (QK-norm bound)", wd8, ws8, inputs,
                        compile_opts=base, graphs=False, ref=ref)
        if r:
            profile(f"{TAG}static scales + fa3 fp8 attention (QK-norm bound)", r[2], r[3], inputs)
    return d, s_, cur


def levers(dbl, sgl, inputs, base, ref):
    """Per-step levers, each an A/B against FluxAccel's default at block level (FP8 per-row plain, cuDNN-first
    attention override, torch RoPE; no CUDA graphs, as under ComfyUI 0.33's default cudaMallocAsync), with a kernel
    profile of the default and of each lever that pays."""
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    wd, ws = _Opts(d, {OVERRIDE_KEY: sdpa_cudnn_first}, True), _Opts(s_, {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    cur = run_variant("default: fp8 row plain compile", wd, ws, inputs, compile_opts=base, graphs=False, ref=ref)
    if cur:
        profile("default: fp8 row plain compile", cur[2], cur[3], inputs)
    static = StaticScale(d, s_)
    img, txt, vec, pe, x, vs = inputs
    with torch.inference_mode():
        static.calibrate(lambda: (wd(img.clone(), txt.clone(), vec, pe), ws(x.clone(), vs, pe)))
    with static.on():
        st = run_variant("static per-tensor activation scales", wd, ws, inputs, compile_opts=base, graphs=False,
                         ref=ref)
        if st:
            profile("static per-tensor activation scales", st[2], st[3], inputs)
    run_variant("coordinate_descent_tuning", wd, ws, inputs, compile_opts={**base, "coordinate_descent_tuning": True},
                graphs=False, ref=ref)
    with static.on():
        run_variant("static scales + coordinate_descent_tuning", wd, ws, inputs,
                    compile_opts={**base, "coordinate_descent_tuning": True}, graphs=False, ref=ref)
    run_variant("default with CUDA graphs (--disable-cuda-malloc)", wd, ws, inputs, compile_opts=base, ref=ref)


def copy_ceiling() -> float:
    """GB/s of a device-to-device copy of 2 GiB (read + write): the memory bandwidth a pointwise kernel can reach."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * 2 * 1024**3 / 1e9 / (ms / 1e3)


class _KernelLines(logging.Handler):
    """Inductor's profile_bandwidth lines (one per Triton kernel at its first launch, timed alone; then a SUMMARY line
    per graph call), collected per graph call: [[(ms, GB, kernel), ...] per call]."""

    LINE = re.compile(r"([0-9.]+)ms\s+([0-9.]+) GB\s+[0-9.]+GB/s\s+(\S+)")

    def __init__(self):
        super().__init__(logging.INFO)
        self.calls: list[list[tuple[float, float, str]]] = [[]]

    def emit(self, record):
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())
        if text.startswith("SUMMARY"):
            self.calls.append([])
            return
        m = self.LINE.search(text)
        if m:
            self.calls[-1].append((float(m.group(1)), float(m.group(2)), m.group(3)))


def _keep_generated_code(folder: Path) -> None:
    """Copy the Python modules inductor generated so far in this process (the compiled graphs' wrappers with their
    Triton kernels' source) into `folder`, for reading the kernels the bandwidth table names."""
    import shutil

    from torch._inductor.codecache import PyCodeCache

    folder.mkdir(parents=True, exist_ok=True)
    for mod in list(PyCodeCache.modules):
        src = Path(getattr(mod, "__file__", "") or "")
        if src.is_file() and "triton_" in src.read_text(errors="replace"):
            shutil.copy(src, folder / src.name)


def bandwidth(dbl, sgl, inputs, base, ref):
    """The elementwise kernels' bytes against the memory's ceiling: inductor's own per-kernel measurement
    (profile_bandwidth: each Triton kernel timed alone at its first launch, its bytes from its buffers) of the
    default's compiled blocks and of static activation scales, against a device-to-device copy's bandwidth; a step
    estimated as 19 double + 38 single blocks."""
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    ceiling = copy_ceiling()
    emit("copy_ceiling", gb_per_s=round(ceiling))
    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    wd, ws = _Opts(d, {OVERRIDE_KEY: sdpa_cudnn_first}, True), _Opts(s_, {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    static = StaticScale(d, s_)
    img, txt, vec, pe, x, vs = inputs
    with torch.inference_mode():
        static.calibrate(lambda: (wd(img.clone(), txt.clone(), vec, pe), ws(x.clone(), vs, pe)))
    for name, ctx in (("default: fp8 row plain compile", contextlib.nullcontext),
                      ("static per-tensor activation scales", static.on)):
        lines = _KernelLines()
        logger = logging.getLogger("torch._inductor.runtime.triton_heuristics")
        logger.addHandler(lines)
        before = logger.level
        logger.setLevel(logging.INFO)
        try:
            with ctx():
                run_variant(f"{name} (profile_bandwidth)", wd, ws, inputs,
                            compile_opts={**base, "profile_bandwidth": True,
                                          # each kernel's device time from the profiler's trace, not the timed loop
                                          # (which clones in-place buffers and counts host gaps)
                                          "profile_bandwidth_with_do_bench_using_profiling": True},
                            graphs=False, ref=ref)
        finally:
            logger.removeHandler(lines)
            logger.setLevel(before)
        _keep_generated_code(OUT_DIR / f"kernels-{'static' if 'static' in name else 'default'}")
        calls = [c for c in lines.calls if c]
        (OUT_DIR / f"bandwidth-{'static' if 'static' in name else 'default'}.json").write_text(json.dumps(calls[:2]))
        if len(calls) < 2:
            emit("bandwidth", name=name, error=f"profile_bandwidth logged {len(calls)} graph calls, 2 expected")
            continue
        dbl_rows, sgl_rows = calls[:2]  # the double block's first call, then the single block's
        step = {k: round(BLOCKS[0] * sum(r_[i] for r_ in dbl_rows) + BLOCKS[1] * sum(r_[i] for r_ in sgl_rows), 2)
                for k, i in (("triton_ms_per_step", 0), ("triton_gb_per_step", 1))}
        step["triton_ms_per_step_at_copy_bandwidth"] = round(step["triton_gb_per_step"] / ceiling * 1e3, 2)
        emit("bandwidth", name=name, kernels=[len(dbl_rows), len(sgl_rows)], **step,
             achieved_gb_per_s=round(step["triton_gb_per_step"] / step["triton_ms_per_step"] * 1e3),
             top_double=[(k[:70], t, b, round(b / t * 1e3)) for t, b, k in sorted(dbl_rows, reverse=True)[:10]],
             top_single=[(k[:70], t, b, round(b / t * 1e3)) for t, b, k in sorted(sgl_rows, reverse=True)[:10]])


class _GeluFp8(torch.nn.Module):
    """Lever probe: an MLP's GELU and its second (FP8 plain) Linear's row-wise activation quantization in one pass
    (core/quant/act_quant.py), then the same FP8 GEMM. gelu_from: the first column GELU applies to (the single
    block's input is its attention output concatenated before the MLP's)."""

    def __init__(self, lin, gelu_from=0):
        super().__init__()
        self.lin, self.gelu_from = lin, gelu_from

    def forward(self, x):
        from fluxaccel.core.quant import act_quant

        lin, kw = self.lin, self.lin.fp8_act_kwargs
        q, scale = act_quant.gelu_rowwise_fp8(x, self.gelu_from, kw.hp_value_lb, kw.hp_value_ub)
        return _fp8_gemm(lin, q, scale, x.dtype).reshape(*x.shape[:-1], lin.weight.shape[0])


def _fp8_gemm(lin, q, scale, x_dtype):
    """The FP8 plain Linear's GEMM of an already-quantized input (q, its row scales)."""
    from fluxaccel.core.quant import fp8

    ao = fp8.float8_ops()
    a, b = ao.preprocess_data(q, lin.weight.t(), lin.fp8_mm_config)
    return ao.addmm(a, scale, b, lin.fp8_weight_scale.t(), output_dtype=x_dtype, bias=lin.bias,
                    use_fast_accum=lin.fp8_mm_config.use_fast_accum)


class _SinglePair(torch.nn.Module):
    """Lever probe: ComfyUI 0.33's SingleStreamBlock.forward (FLUX.1: its modulation inside, no patches, no
    modulation_dims) with linear2's input quantized from the attention output and the MLP stream apart
    (act_quant.gelu_pair_rowwise_fp8: GELU, one row scale, FP8), so the concatenation is never written. block: an FP8
    per-row plain copy."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, vec, pe, attn_mask=None, transformer_options={}):
        from comfy.ldm.flux.layers import apply_mod
        from comfy.ldm.flux.math import attention

        from fluxaccel.core.quant import act_quant

        b = self.block
        mod, _ = b.modulation(vec)
        qkv, mlp = torch.split(b.linear1(apply_mod(b.pre_norm(x), (1 + mod.scale), mod.shift)),
                               [3 * b.hidden_size, b.mlp_hidden_dim_first], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, b.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = b.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        q8, scale = act_quant.gelu_pair_rowwise_fp8(attn, mlp)
        out = _fp8_gemm(b.linear2, q8, scale, x.dtype).reshape(*x.shape[:-1], -1)
        x += apply_mod(out, mod.gate)
        return x


class _SiluFp8(torch.nn.Module):
    """Lever probe (FLUX.2): a SiLU-gated MLP's gate (SiLU(m1) * m2) and its second (FP8 plain) Linear's row-wise
    activation quantization in one pass, then the same FP8 GEMM; m = the first Linear's output, passed whole (an
    Identity in SiLUActivation's place). The product's operator (act_quant.py), as Quantize FP8's fuse_silu_gate
    runs it."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, m):
        from fluxaccel.core.quant import act_quant

        q, scale = act_quant.silu_gate_rowwise_fp8(m)
        return _fp8_gemm(self.lin, q, scale, m.dtype).reshape(*m.shape[:-1], self.lin.weight.shape[0])


class _SinglePairSilu(torch.nn.Module):
    """Lever probe (FLUX.2): ComfyUI 0.33's SingleStreamBlock.forward for a block without modulation of its own and a
    SiLU-gated MLP (no patches, no modulation_dims), linear2's input quantized from the attention output and the MLP
    stream apart (the product's act_quant.silu_gate_pair_rowwise_fp8), its concatenation never written. block: an FP8
    per-row plain copy."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, vec, pe, attn_mask=None, transformer_options={}):
        from comfy.ldm.flux.layers import apply_mod
        from comfy.ldm.flux.math import attention

        from fluxaccel.core.quant import act_quant

        b, mod = self.block, vec
        qkv, mlp = torch.split(b.linear1(apply_mod(b.pre_norm(x), (1 + mod.scale), mod.shift)),
                               [3 * b.hidden_size, b.mlp_hidden_dim_first], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, b.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = b.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        q8, scale = act_quant.silu_gate_pair_rowwise_fp8(attn, mlp)
        out = _fp8_gemm(b.linear2, q8, scale, x.dtype).reshape(*x.shape[:-1], -1)
        x += apply_mod(out, mod.gate)
        return x


def fused_copy(dbl, sgl, single: bool):
    """FP8 per-row plain copies of the blocks with the MLP's GELU fused into the next Linear's quantization (double
    blocks' img/txt MLPs; with `single`, the single block's linear2 too, after its concatenation)."""
    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    for mlp in (d.img_mlp, d.txt_mlp):
        mlp[1], mlp[2] = torch.nn.Identity(), _GeluFp8(mlp[2])
    if single:
        s_.mlp_act, s_.linear2 = torch.nn.Identity(), _GeluFp8(s_.linear2, s_.hidden_size)
    return d, s_


def kernel_table(name, fd, fs, inputs):
    """Every kernel of one double and one single block call, device time from the profiler (mean of 5 calls)."""
    from torch.profiler import ProfilerActivity, profile as prof

    img, txt, vec, pe, x, vs = inputs
    out = {}
    with torch.inference_mode():
        for part, fn in (("double", lambda: fd(img, txt, vec, pe)), ("single", lambda: fs(x, vs, pe))):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            rows = []
            for ev in p.key_averages():
                us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if us > 0 and str(getattr(ev, "device_type", "CUDA")).endswith("CUDA"):
                    rows.append((ev.key, round(us / 5 / 1000, 4)))
            out[part] = sorted(rows, key=lambda r: -r[1])
    emit("kernels", name=name, **out, **{f"{k}_ms_sum": round(sum(t for _, t in v), 4) for k, v in out.items()})


def _device_ms(fn, kernel: str, calls: int = 20) -> float:
    """The mean device time of the kernels named `kernel` over `calls` calls of fn, from the profiler's trace (an
    eager op's Python dispatch is not in it)."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum((getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0))
             for ev in p.key_averages() if ev.key.startswith(kernel))
    return us / calls / 1000


def act_quant_kernel():
    """The GELU + row-wise FP8 kernel alone at FLUX.1-dev's shapes, per warps-per-row setting (its device time from
    the profiler), against its torch reference (values) and a device copy (bandwidth); sets the fastest setting for
    the block variants."""
    from fluxaccel.core.quant import act_quant

    ceiling = copy_ceiling()
    g = torch.Generator(device=DEV).manual_seed(3)
    best = {}
    for m, n, gf in ((4096, 12288, 0), (4608, 15360, 3072), (512, 12288, 0)):
        h = (torch.randn(m, n, device=DEV, generator=g) * 2).to(torch.bfloat16)
        rq, rs = act_quant.reference(h, gf)
        gb = (h.numel() * 3 + m * 4) / 1e9
        rows = []
        for per in (2048, 1024, 512):
            act_quant.WARPS_PER_ELEMENTS = per
            q, sc = act_quant.gelu_rowwise_fp8(h, gf)
            ms = _device_ms(lambda: act_quant.gelu_rowwise_fp8(h, gf), "gelu_rowwise_fp8_kernel")
            rows.append((ms, per))
            emit("act_quant_kernel", m=m, n=n, gelu_from=gf, warps=act_quant.num_warps(16384), ms=round(ms, 4),
                 eager_call_ms=round(bench_ms(lambda: act_quant.gelu_rowwise_fp8(h, gf), iters=50), 4),
                 gb_per_s=round(gb / ms * 1e3), copy_gb_per_s=round(ceiling),
                 scale_mismatch_frac=float((sc != rs).float().mean()),
                 q_mismatch_frac=float((q.float() != rq.float()).float().mean()),
                 q_max_rel_diff=float(((q.float() - rq.float()).abs() / rq.float().abs().clamp(min=2 ** -6)).max()))
        best[(m, n)] = min(rows)[1]
        try:  # the probe-only variant that recomputes GELU instead of holding it (act_quant_variants.py)
            from bench.probes import act_quant_variants as variants

            for warps in (8, 16):
                q, sc = variants.recompute(h, gf, warps)
                ms = _device_ms(lambda: variants.recompute(h, gf, warps), "gelu_rowwise_fp8_recompute_kernel")
                emit("act_quant_kernel_recompute", m=m, n=n, gelu_from=gf, warps=warps, ms=round(ms, 4),
                     gb_per_s=round(gb / ms * 1e3), scale_equal=bool(torch.equal(sc, rs)),
                     q_mismatch_frac=float((q.float() != rq.float()).float().mean()))
        except Exception as e:  # noqa: BLE001 -- a probe variant: its failure is recorded, the probe goes on
            emit("act_quant_kernel_recompute", m=m, n=n, error=f"{type(e).__name__}: {e}"[:300])
    act_quant.WARPS_PER_ELEMENTS = best[(4096, 12288)]
    emit("act_quant_kernel_choice", warps_per_elements=act_quant.WARPS_PER_ELEMENTS)


def _keep_tar(folder: Path) -> None:
    """The kept generated modules as one file (a device call brings back few files)."""
    import tarfile

    if folder.is_dir():
        with tarfile.open(f"{folder}.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname=folder.name)
        import shutil

        shutil.rmtree(folder)


def fused(dbl, sgl, inputs, base, ref):
    """Row-wise FP8 quantization in one pass: the MLP's GELU + quantization as one hand-written kernel, inductor's
    multi-kernel reductions (persistent or looped, chosen per kernel at run time), wider persistent reductions
    chosen at compile time (torch_internals.persistent_reductions) and the single block without its concatenation
    (_SinglePair), against the default
    (FP8 per-row plain, cuDNN-first attention, torch RoPE, no CUDA graphs), each with every kernel's time.
    PROBE_ONLY (comma-separated): only the variants whose name holds one of these, without the kernel sweep."""
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    only = [w for w in os.environ.get("PROBE_ONLY", "").split(",") if w]  # variants whose name holds one of these
    if not only:
        act_quant_kernel()
    opts = {OVERRIDE_KEY: sdpa_cudnn_first}
    mk1 = {**base, "triton.multi_kernel": 1}
    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    wd, ws = _Opts(d, opts, True), _Opts(s_, opts, True)
    fd_, fs_ = fused_copy(dbl, sgl, single=True)
    fwd, fws = _Opts(fd_, opts, True), _Opts(fs_, opts, True)
    fwp = _Opts(_SinglePair(fp8_copy(sgl, "per_row", "plain")), opts, True)
    from fluxaccel.core.upstream import torch_internals

    def rows(n):  # inductor's caches are keyed by the choice too (torch_internals.persistent_reductions)
        return lambda: torch_internals.persistent_reductions(n, 1024)

    plain = contextlib.nullcontext
    for name, a, b, o, w in (("default: fp8 row plain compile", wd, ws, base, plain),
                             ("multi_kernel 1", wd, ws, mk1, plain),
                             ("persistent rows <= 4096, others <= 1024", wd, ws, base, rows(4096)),
                             ("persistent rows <= 16384, others <= 1024", wd, ws, base, rows(16384)),
                             ("fused GELU+quant kernel (double and single MLPs)", fwd, fws, base, plain),
                             ("fused GELU+quant kernel + persistent rows <= 4096, others <= 1024", fwd, fws, base,
                              rows(4096)),
                             ("fused GELU+quant kernel, single block without its concatenation (pair kernel) + "
                              "persistent rows <= 4096, others <= 1024", fwd, fwp, base, rows(4096))):
        if only and not any(w in name for w in only):
            continue
        r = run_variant(name, a, b, inputs, compile_opts=o, graphs=False, ref=ref, within=w)
        if r:
            kernel_table(name, r[2], r[3], inputs)
    _keep_generated_code(OUT_DIR / "kernels")
    _keep_tar(OUT_DIR / "kernels")


def _flux2_case():
    """FLUX.2 [dev]'s blocks at 1024² with 512 text tokens, their inputs and their bf16 eager outputs (the reference
    of every variant's error); step estimates from here on count 8 double + 48 single blocks."""
    global BLOCKS, TAG
    BLOCKS, TAG = (8, 48), "flux2-dev: "
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    dbl, sgl, emb, ids, vec_d, vec_s = build_flux2_blocks()
    g = torch.Generator(device="cuda").manual_seed(1)
    img = torch.randn(1, 4096, 6144, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, 512, 6144, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.inference_mode():
        pe = emb(ids)
    inputs = (img, txt, vec_d, pe, torch.cat([txt, img], 1), vec_s)
    eager = run_variant(f"{TAG}bf16 eager", dbl, sgl, inputs)
    return dbl, sgl, inputs, (eager[0], eager[1]) if eager else None


def flux2(base):
    """The per-step levers on FLUX.2 [dev]'s blocks (a step estimated as 8 double + 48 single)."""
    dbl, sgl, inputs, ref = _flux2_case()
    got = fp8_attention(dbl, sgl, inputs, base, ref)
    if not got:
        return
    d, s_, _ = got
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first

    wd, ws = _Opts(d, {OVERRIDE_KEY: sdpa_cudnn_first}, True), _Opts(s_, {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    run_variant(f"{TAG}coordinate_descent_tuning", wd, ws, inputs,
                compile_opts={**base, "coordinate_descent_tuning": True}, graphs=False, ref=ref)


def flux2_rows(base):
    """FLUX.2 [dev]'s blocks (a step = 8 double + 48 single) under persistent-reduction limits 4,096 and 8,192 (FLUX.2's
    6,144-wide LayerNorm rows persistent with the second), against inductor's own rule, then with the SiLU-gated MLP's
    gate and activation quantization in one pass (act_quant.silu_gate_rowwise_fp8 / silu_gate_pair_rowwise_fp8: the
    double blocks' MLPs; the single block's linear2 without its concatenation), with every kernel's device time. PROBE_ONLY
    (comma-separated): only the limit variants whose name holds one of these (the fused ones always run)."""
    dbl, sgl, inputs, ref = _flux2_case()
    from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first
    from fluxaccel.core.upstream import torch_internals

    d, s_ = fp8_copy(dbl, "per_row", "plain"), fp8_copy(sgl, "per_row", "plain")
    del dbl, sgl
    wd, ws = _Opts(d, {OVERRIDE_KEY: sdpa_cudnn_first}, True), _Opts(s_, {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    only = [w for w in os.environ.get("PROBE_ONLY", "").split(",") if w]  # variants whose name holds one of these
    for name, within in (("inductor's rule", contextlib.nullcontext),
                         ("persistent rows <= 4096, others <= 1024 (the product)",
                          lambda: torch_internals.persistent_reductions(4096, 1024)),
                         ("persistent rows <= 8192, others <= 1024",
                          lambda: torch_internals.persistent_reductions(8192, 1024))):
        if only and not any(w in name for w in only):
            continue
        r = run_variant(f"{TAG}fp8 row plain compile, {name}", wd, ws, inputs, compile_opts=base, graphs=False,
                        ref=ref, within=within)
        if r:
            kernel_table(f"{TAG}{name}", r[2], r[3], inputs)
    for mlp in (d.img_mlp, d.txt_mlp):  # the SiLU gate fused into the FP8 quantization after it
        mlp[1], mlp[2] = torch.nn.Identity(), _SiluFp8(mlp[2])
    wp = _Opts(_SinglePairSilu(s_), {OVERRIDE_KEY: sdpa_cudnn_first}, True)
    for name, single in (("fused SiLU-gate+quant kernel (double MLPs)", ws),
                         ("fused SiLU-gate+quant kernel (double MLPs; single linear2 without its concatenation)", wp)):
        r = run_variant(f"{TAG}{name} + persistent rows <= 8192", wd, single, inputs, compile_opts=base,
                        graphs=False, ref=ref, within=lambda: torch_internals.persistent_reductions(8192, 1024))
        if r:
            kernel_table(f"{TAG}{name}", r[2], r[3], inputs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--host-diff", action="store_true",
                    help="FP8 per-row plain compiled blocks with the host's own attention, with FluxAccel's cuDNN-first "
                         "override, and with plain-torch RoPE too; a kernel profile of each")
    ap.add_argument("--levers", action="store_true",
                    help="per-step levers against the default (coordinate-descent tuning, static activation scales), "
                         "with kernel profiles")
    ap.add_argument("--fa3", action="store_true",
                    help="FP8 attention (FlashAttention-3's FP8 kernel, the fa3-fwd wheel) against the default, with "
                         "the error and a kernel profile")
    ap.add_argument("--flux2-rows", action="store_true",
                    help="FLUX.2 [dev]'s blocks under persistent-reduction limits 4,096 and 8,192, with kernel tables")
    ap.add_argument("--flux2", action="store_true",
                    help="also FLUX.2 [dev]'s blocks (8 double + 48 single): the default, static activation scales, "
                         "FP8 attention, coordinate-descent tuning")
    ap.add_argument("--gemm-cases", default="",
                    help="GEMM micro-benchmarks of these cases' shapes (comma-separated: dev-1024, schnell-512, "
                         "flux2dev-1024): the FP8 GEMM time a step cannot go below")
    ap.add_argument("--bandwidth", action="store_true",
                    help="the compiled blocks' Triton kernels, bytes and time each (inductor's profile_bandwidth), "
                         "against a device copy's bandwidth: the default and static activation scales")
    ap.add_argument("--fused", action="store_true",
                    help="row-wise FP8 quantization in one pass: inductor's persistent reductions, and the MLP's GELU + "
                         "quantization as one kernel, against the default, with every kernel's time")
    ap.add_argument("--layouts", action="store_true",
                    help="only FP8 per-row compile+graphs in the Float8Tensor vs plain layout, and a kernel profile of each")
    a = ap.parse_args()
    global OUT_DIR
    OUT_DIR = Path(a.out)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    emit("env", torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
         cudnn=torch.backends.cudnn.version())
    if a.flux2_rows:  # FLUX.2's blocks only
        flux2_rows({"emulate_precision_casts": True})
        _keep_generated_code(OUT_DIR / "kernels")
        _keep_tar(OUT_DIR / "kernels")
        table()
        return
    if not (a.skip_micro or a.layouts or a.levers or a.fa3 or a.gemm_cases or a.bandwidth
            or a.fused):
        sdpa_backends()
        gemms()
    for case in filter(None, a.gemm_cases.split(",")):
        gemms(case)
    dbl, sgl, emb, ids = build_blocks()
    with torch.inference_mode():
        pe = emb(ids)
        emit("rope", eager_ms=round(bench_ms(lambda: emb(ids)), 4),
             compiled_ms=round(bench_ms(torch.compile(lambda: emb(ids), dynamic=False)), 4))
    g = torch.Generator(device="cuda").manual_seed(1)
    img = torch.randn(1, 4096, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, 512, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    vec = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.cat([txt, img], 1)
    inputs = (img, txt, vec, pe, x, vec)
    base = {"emulate_precision_casts": True}
    eager = run_variant("bf16 eager", dbl, sgl, inputs)
    ref = (eager[0], eager[1]) if eager else None
    if a.fa3 or a.flux2:
        if a.fa3:
            fp8_attention(dbl, sgl, inputs, base, ref)
        if a.flux2:
            del dbl, sgl, eager
            flux2(base)
        table()
        return
    if a.fused:
        fused(dbl, sgl, inputs, base, ref)
        table()
        return
    if a.bandwidth:
        bandwidth(dbl, sgl, inputs, base, ref)
        table()
        return
    if a.levers:
        levers(dbl, sgl, inputs, base, ref)
        table()
        return
    if a.host_diff:  # ComfyUI 0.33 vs 0.3.75 inside FluxAccel's compiled FLUX (bench/NOTES.md, session 6)
        host_diff(dbl, sgl, inputs, base, ref)
        return
    if a.layouts:  # why the plain layout's compiled call takes less device time (bench/NOTES.md, session 4)
        for layout in ("subclass", "plain"):
            d, s_ = fp8_copy(dbl, "per_row", layout), fp8_copy(sgl, "per_row", layout)
            run_variant(f"fp8 row {layout} compile+graphs", d, s_, inputs, compile_opts=base, ref=ref)
            nog = run_variant(f"fp8 row {layout} compile (no graphs, for profile)", d, s_, inputs,
                              compile_opts=base, graphs=False, ref=ref)
            if nog:
                profile(f"fp8 row {layout} compile", nog[2], nog[3], inputs)
            del d, s_
        return
    dr, sr = fp8_copy(dbl, "per_row"), fp8_copy(sgl, "per_row")
    dt, st = fp8_copy(dbl, "per_tensor"), fp8_copy(sgl, "per_tensor")
    run_variant("bf16 eager cudnn", dbl, sgl, inputs, attn="cudnn", ref=ref)
    run_variant("fp8 row eager", dr, sr, inputs, ref=ref)
    run_variant("bf16 compile+graphs", dbl, sgl, inputs, compile_opts=base, ref=ref)
    cur = run_variant("fp8 row compile+graphs (current)", dr, sr, inputs, compile_opts=base, ref=ref)
    run_variant("fp8 row compile+graphs no-emulate", dr, sr, inputs, compile_opts={}, ref=ref)
    run_variant("fp8 tensor compile+graphs", dt, st, inputs, compile_opts=base, ref=ref)
    best = run_variant("fp8 row compile+graphs cudnn", dr, sr, inputs, compile_opts=base, attn="cudnn", ref=ref)
    run_variant("bf16 compile+graphs cudnn", dbl, sgl, inputs, compile_opts=base, attn="cudnn", ref=ref)
    run_variant("fp8 tensor compile+graphs cudnn", dt, st, inputs, compile_opts=base, attn="cudnn", ref=ref)
    # profile without graphs (kernel names stay visible)
    if time.time() - T0 < BUDGET_S:
        nog = run_variant("fp8 row compile cudnn (no graphs, for profile)", dr, sr, inputs, compile_opts=base,
                          graphs=False, attn="cudnn", ref=ref)
        if nog:
            profile("fp8 row compile cudnn", nog[2], nog[3], inputs, attn="cudnn")
    run_variant("fp8 row max-autotune-no-cudagraphs+graphs cudnn", dr, sr, inputs,
                compile_opts={**base, **torch._inductor.list_mode_options("max-autotune-no-cudagraphs")},
                attn="cudnn", ref=ref)
    table()


def table():
    print("\n== variants (ms; step estimate = 19 double + 38 single) ==")
    for r in RESULTS:
        if r["kind"] == "variant":
            print(f"{r['name'][:52]:52s} {r.get('double_ms', '-')!s:>8} {r.get('single_ms', '-')!s:>8} "
                  f"{r.get('step_ms_est', r.get('error', r.get('skipped', '')))!s:>10} "
                  f"first {r.get('first_s', '-')} err {r.get('rel_err_single', '-')}")


if __name__ == "__main__":
    main()
