"""What FluxAccel has applied to a ModelPatcher: a label, a description, and the model without it."""
from __future__ import annotations

from .compile.patch import compiled_of, remove_compile
from .parallel import patch as parallel_patch
from .parallel.patch import remove_parallel
from .quant.patch import fp8_state, remove_fp8
from .upstream import degradations


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def compute_dtype(model) -> str:
    """The dtype the diffusion model computes in, as ComfyUI set it up: its manual-cast dtype where weights are
    stored in another (e.g. bf16 weights computed in float32 on a CPU), else the weights' dtype."""
    bm = model.model
    infer = getattr(bm, "get_dtype_inference", None)  # ComfyUI's own answer (0.33+)
    dt = infer() if callable(infer) else (getattr(bm, "manual_cast_dtype", None) or bm.get_dtype())
    name = str(dt).replace("torch.", "")
    return _SHORT.get(name, name)


def label(model) -> str:
    """e.g. 'bf16', 'fp32' (what the model computes in), 'fp8-per_row', 'fp8-per_row+compile+graphs',
    'fp8-per_row-blocks+modulation' (the scope is named when it is not the default 'blocks'),
    '...+compile+graphs+fp8-attention', 'bf16+parallel-2gpus' ('+parallel-2cpu-workers' on a machine without CUDA
    devices). '+graphs' only where CUDA graphs run (a GPU, none lost)."""
    fp8 = fp8_state(model)
    name = compute_dtype(model)
    if fp8:
        c = fp8.config
        name = f"fp8-{c.granularity}" + ("" if c.scope == "blocks" else f"-{c.scope}")
    c = compiled_of(model)
    if c is not None:
        name += "+compile" + ("+graphs" if c.graphs_running else "")  # only where graphs run (CUDA, none dropped)
        if c.cfg.mode != "default":
            name += f"+{c.cfg.mode}"
        if c.cfg.attention != "cudnn":
            name += f"+{c.cfg.attention}-attention"
    p = parallel_patch.parallel_of(model)
    if p is not None:
        name += parallel_patch.label(p)
    return name


def describe(model) -> dict:
    out = {"label": label(model)}
    fp8 = fp8_state(model)
    if fp8:
        r = fp8.report
        out["fp8"] = {"granularity": r.granularity, "scope": r.scope, "quantized": len(r.quantized),
                      "bytes_saved": r.bytes_saved}
    c = compiled_of(model)
    if c is not None:
        st = c.stats
        out["compile"] = {"cuda_graphs": c.graphs_running, "mode": c.cfg.mode, "policy": c.cfg.resolution_policy,
                          "attention": c.cfg.attention,
                          "shapes": [k.describe() for k in st.shapes],
                          "compile_seconds": {k.describe(): round(v, 2) for k, v in st.compile_seconds.items()},
                          "compile_phases_s": {k.describe(): v for k, v in st.compile_phases.items()},
                          "calls": st.calls, "eager_calls": st.eager_calls, "cache_loaded": st.cache_loaded,
                          "warm_start": {k.describe(): v for k, v in st.warm_start.items()},
                          "warm_start_off": st.warm_start_off, "attention_note": st.attention_note,
                          "separate_process": {k.describe(): v for k, v in st.separate.items()},
                          "uncompiled_while_compiling": st.uncompiled_while_compiling,
                          "graphs_off_reason": c.setup.capture_off,
                          **({"call_graphs": c.runner.call_graphs.counts()} if c.runner.call_graphs else {}),
                          **({"modulation_table": c.runner.mod_table.counts()} if c.runner.mod_table else {}),
                          "graphs_lost": {k.describe(): v for k, v in st.graphs_lost.items()},
                          "model_compiler_paused_calls": st.model_compiler_paused,
                          "model_compiler_unknown_calls": st.model_compiler_unknown,
                          **st.call_timings()}
    # what runs below what was asked: the compiled model's own list (what, why, since), then upstream internals this
    # process could not find and what FluxAccel does instead (core/upstream)
    own = [d.line() for d in c.stats.degradations] if c is not None else []
    out["degradations"] = own + degradations()
    return out


def strip(model):
    """The same model with every FluxAccel patch removed (the Benchmark's default baseline)."""
    return remove_fp8(remove_compile(remove_parallel(model)))
