"""core/compile/compiled.py + patch.py on the CPU: inductor's CPU backend, tiny FLUX, ComfyUI's real sampler. The
CPU runs the same path as a GPU -- each kind of block compiled once -- without the CUDA-graph capture
(test_call_graphs.py tests the capture with a stand-in)."""
import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from fluxaccel.core.compile.config import CompileConfig

from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.compile.patch import apply_compile, compiled_of, remove_compile
from fluxaccel.core.quant.patch import fp8_state
from fluxaccel.core.models.patcher import owner_of
from fluxaccel.core.models.loaded import compiled_elsewhere
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.bench.metrics import rel_err
from support.models import build_flux
from support.runs import clear_compile_counters, compiled_graphs
from support.runs import denoise_once as _denoise_once
from support.runs import sample as _sample


@pytest.fixture
def counters():
    clear_compile_counters()
    torch._dynamo.reset()
    yield dynamo_utils.counters
    torch._dynamo.reset()


def test_inductor_options_per_call():
    """Inductor's own CUDA graphs are always off (FluxAccel captures whole calls); a captured call's blocks use the C++
    wrapper without a CPU vector ISA; a mode adds its options."""
    plain = CompileConfig().inductor_options(capture=False)
    assert plain == {"triton.cudagraphs": False, "emulate_precision_casts": True}
    captured = CompileConfig().inductor_options(capture=True)
    assert captured == {**plain, "cpp_wrapper": True, "cpp.vec_isa_ok": False}
    autotune = CompileConfig(mode="max-autotune").inductor_options(capture=True)
    assert autotune["triton.cudagraphs"] is False and autotune["max_autotune"] is True
    tuned = CompileConfig(mode="tuned-kernels").inductor_options(capture=False)
    assert tuned == {"coordinate_descent_tuning": True, **plain}
    assert "mode tuned-kernels" in CompileConfig(mode="tuned-kernels").summary("")


def test_removed_inputs_are_said_and_unknown_ones_refused(caplog):
    """A saved workflow's inputs the node no longer has (cuda_graphs, graph_capture, ...) load with one log line and
    are left to FluxAccel; a name the node never had is refused by name."""
    import logging

    with caplog.at_level(logging.INFO, logger="fluxaccel.nodes"):
        cfg = CompileConfig.from_inputs({"mode": "tuned-kernels", "cuda_graphs": False, "graph_capture": "inductor",
                                         "separate_process": False}, "C")
    assert cfg == CompileConfig(mode="tuned-kernels")
    said = [r.getMessage() for r in caplog.records if r.name == "fluxaccel.nodes"]
    assert len(said) == 1 and "cuda_graphs=False, graph_capture='inductor', separate_process=False" in said[0]
    with pytest.raises(FluxAccelError, match="C has no input 'max_shape'"):
        CompileConfig.from_inputs({"max_shape": 3}, "C")


def test_compiled_forward_matches_eager_bf16(tiny_flux, counters):
    ref = _denoise_once(tiny_flux)
    model, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    out = _denoise_once(model)
    assert compiled.stats.calls == 1 and compiled_graphs() >= 1
    e = rel_err(out, ref)
    assert e < 2e-2, e  # bf16: inductor fuses/reorders roundings; one forward stays within ~1%
    assert torch.equal(_denoise_once(tiny_flux), ref), "the input model must stay uncompiled"


def test_sampling_float32_compiled_equals_eager_one_compile_per_shape(counters):
    base = build_flux("tiny", dtype=torch.float32)
    ref = _sample(base, seed=1)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    out = _sample(model, seed=1)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)  # float32: only summation order differs
    graphs = compiled_graphs()
    assert graphs == 2 and compiled.stats.calls == 2  # one graph per kind of block (no graph breaks)
    # other seeds and other prompt text of the same length: transformer_options differ (uuids, sigmas,
    # wrappers, conds), yet no guard fires -> no new graph
    _sample(model, seed=2, text_seed=5)
    assert compiled_graphs() == graphs, "other seeds/prompt text must not recompile"
    _sample(model, seed=3, steps=3, cfg=2.0, text_seed=9, batch=1)  # cfg>1 batches cond+uncond: batch 2
    new_shape_graphs = compiled_graphs()
    assert new_shape_graphs == 4, "one compile of each block kind per shape"
    _sample(model, seed=4, cfg=2.0, text_seed=11)
    assert compiled_graphs() == new_shape_graphs, "a repeated shape must not recompile"
    assert compiled.stats.shapes == [ShapeKey(1, 16, 16, 16, "float32"), ShapeKey(2, 16, 16, 16, "float32")]


def test_strict_policy_names_both_shapes(tiny_flux, counters):
    model, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="strict", separate_process=False))
    _denoise_once(model)
    with pytest.raises(FluxAccelError, match=r"compiled for batch 1, latent 16x16 \(128x128 px\), 16 text tokens.*"
                                             r"received batch 1, latent 24x24 \(192x192 px\).*resolution_policy"):
        _denoise_once(model, hw=24)
    with pytest.raises(FluxAccelError, match="received batch 1, latent 16x16 .*, 40 text tokens"):
        _denoise_once(model, text_len=40)
    _denoise_once(model)  # the compiled shape still works afterwards
    assert compiled.stats.shapes == [ShapeKey(1, 16, 16, 16, "bfloat16")]


def test_recompile_policy_up_to_max_shapes(tiny_flux, counters):
    model, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="recompile", max_shapes=2, separate_process=False))
    _denoise_once(model)
    g1 = compiled_graphs()
    _denoise_once(model, hw=24)
    assert compiled_graphs() > g1 and len(compiled.stats.shapes) == 2
    g2, eager = compiled_graphs(), compiled.stats.eager_calls
    _denoise_once(model, hw=32)  # past max_shapes: runs uncompiled, counted, nothing compiled
    assert compiled_graphs() == g2 and compiled.stats.eager_calls == eager + 1 and len(compiled.stats.shapes) == 2


def test_shapes_and_variants_beyond_dynamos_recompile_limit_still_compile(tiny_flux, counters):
    """dynamo counts recompiles per code object, shared by every CompiledFlux of the process (torch's default 8). With
    the process-wide limit lowered to 1, two variants x two shapes must all compile: our calls carry their own budget,
    and the process setting is unchanged after them."""
    import torch._dynamo.config as dc

    with dc.patch(recompile_limit=1):
        a, ca = apply_compile(tiny_flux, CompileConfig(resolution_policy="recompile", max_shapes=2, separate_process=False))
        b, cb = apply_compile(tiny_flux, CompileConfig(resolution_policy="recompile", max_shapes=2,
                                                       mode="tuned-kernels", separate_process=False))
        for model in (a, b):
            for hw in (16, 24):
                g = compiled_graphs()
                _denoise_once(model, hw=hw)
                assert compiled_graphs() > g, f"hw {hw}: no graph made"
        assert dc.recompile_limit == 1
    for c in (ca, cb):
        assert c.stats.eager_calls == 0 and len(c.stats.compile_seconds) == 2


def test_eager_fallback_runs_uncompiled(tiny_flux, counters):
    ref24 = _denoise_once(tiny_flux, hw=24)
    model, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="eager_fallback", separate_process=False))
    _denoise_once(model)
    g1 = compiled_graphs()
    out = _denoise_once(model, hw=24)
    assert compiled.stats.eager_calls == 1 and compiled_graphs() == g1
    assert torch.equal(out, ref24)


@pytest.mark.parametrize("cfg,sampler,evals_per_step", [(1.0, "euler", 1), (3.5, "euler", 1), (1.0, "heun", 2)])
def test_one_compiled_call_per_model_call(tiny_flux, counters, cfg, sampler, evals_per_step):
    model, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    calls = []

    def count_calls(apply_model, args):  # ComfyUI's unet wrapper: one call per model evaluation
        calls.append(args["input"].shape[0])
        return apply_model(args["input"], args["timestep"], **args["c"])

    model.set_model_unet_function_wrapper(count_calls)
    steps = 3
    _sample(model, steps=steps, cfg=cfg, sampler=sampler)
    assert len(calls) == compiled.stats.calls and compiled.stats.eager_calls == 0
    # heun: 2 evaluations per step except the last; cfg 3.5: cond+uncond batched into one call of batch 2
    assert len(calls) == (steps * 2 - 1 if evals_per_step == 2 else steps)
    assert set(calls) == ({2} if cfg > 1 else {1})


@pytest.mark.parametrize("keys", [["diffusion_model"], ["diffusion_model.double_blocks.0"]], ids=["whole", "per-block"])
def test_comfyuis_compile_before_ours_is_replaced(tiny_flux, keys, caplog):
    """ComfyUI's TorchCompileModel (whole model or per block) before Compile: FluxAccel compiles the blocks itself,
    so ComfyUI's wrapper is taken off its clone (said in the log) and the input model keeps it."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    theirs = tiny_flux.clone()
    set_torch_compile_wrapper(theirs, backend="inductor", keys=keys)
    with caplog.at_level("INFO", logger="fluxaccel.compile"):
        ours, _ = apply_compile(theirs, CompileConfig(separate_process=False))
    assert ours.get_wrappers("apply_model", "torch.compile") == [] and compiled_of(ours) is not None
    assert theirs.get_wrappers("apply_model", "torch.compile") and "replacing ComfyUI's torch.compile" in caplog.text


def test_a_block_compiled_by_another_node_is_refused_for_the_true_reason(tiny_flux):
    compiled = tiny_flux.clone()
    compiled.add_object_patch("diffusion_model.double_blocks.0",
                              torch.compile(tiny_flux.model.diffusion_model.double_blocks[0]))
    assert compiled_elsewhere(compiled) == ["compiled object patch diffusion_model.double_blocks.0"]
    with pytest.raises(FluxAccelError, match=r"already compiled or captured by another node \(compiled object patch "
                                             r"diffusion_model\.double_blocks\.0\)\. FluxAccel compiles each FLUX block "
                                             r"itself"):
        apply_compile(compiled, CompileConfig(separate_process=False))


def test_compiling_twice_replaces_the_wrapper_and_remove_restores(tiny_flux):
    m1, c1 = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    m2, c2 = apply_compile(m1, CompileConfig(resolution_policy="recompile", separate_process=False))
    assert len(m2.get_wrappers("apply_model", "fluxaccel.compile")) == 1 and compiled_of(m2) is c2
    assert compiled_of(remove_compile(m2)) is None and compiled_of(tiny_flux) is None


def test_fp8_then_compile(cpu_fp8, tiny_flux, counters):
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    for gran in ("per_tensor", "per_row"):
        q, _ = apply_fp8(tiny_flux, Fp8Config(gran))
        ref = _denoise_once(q)
        model, compiled = apply_compile(q, CompileConfig(separate_process=False))
        out = _denoise_once(model)
        assert compiled.stats.calls == 1
        assert rel_err(out, ref) < 2e-2, (gran, rel_err(out, ref))


def test_partial_lowvram_load_is_refused(tiny_flux):
    model, _ = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    with pytest.raises(FluxAccelError, match="only partially.*--highvram"):
        model.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1024)
    model.unpatch_model(torch.device("cpu"))


def test_per_call_timings_stay_bounded_over_many_calls(tiny_flux, counters):
    """Host times per call are a bounded window (the last 256 calls), not a list that grows with every step."""
    from fluxaccel.core.compile.compiled import CompiledFlux, Setup

    dm = tiny_flux.model.diffusion_model
    c = CompiledFlux(dm, CompileConfig(persistent_cache=False, separate_process=False),
                     Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "test", "a CPU"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=g).bfloat16()
    ctx, y = torch.randn(1, 8, 64, generator=g).bfloat16(), torch.randn(1, 64, generator=g).bfloat16()
    for _ in range(260):
        c(x, torch.tensor([0.5]), context=ctx, y=y, guidance=torch.tensor([3.5]).bfloat16())
    assert c.stats.calls == 260 and len(c.stats.host_s) == 256
    assert c.stats.call_timings()["model_call_host_ms_median"] > 0


_rel = rel_err


def test_rope_options_are_honoured_compiled(tiny_flux, counters):
    """ComfyUI's ScaleROPE sets rope_options in the model's transformer_options; the compiled model computes with them
    (one sampling step = one denoiser forward), and a second call with them compiles nothing new."""
    m = tiny_flux.clone()
    m.set_model_rope_options(2, 0, 2, 0, 1, 0)
    ref, eager = _sample(tiny_flux, steps=1), _sample(m, steps=1)
    assert _rel(eager, ref) > 0.01, "the option must matter on this model for the test to mean anything"
    clone, c = apply_compile(m, CompileConfig(separate_process=False))
    out = _sample(clone, steps=1)
    g = compiled_graphs()
    _sample(clone, steps=1, seed=3)
    assert compiled_graphs() == g
    assert _rel(out, eager) < 0.02 < _rel(out, ref), (_rel(out, eager), _rel(out, ref))


def test_attention_override_is_honoured_compiled(tiny_flux, counters):
    """An optimized_attention_override (what attention-backend nodes set) runs inside the compiled model: here one
    that halves the attention output, compiled vs eager with it, and clearly not the model without it."""
    calls = []

    def halve(func, *args, **kwargs):
        calls.append(1)
        return func(*args, **kwargs) * 0.5

    m = tiny_flux.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = halve
    ref, eager = _sample(tiny_flux, steps=1), _sample(m, steps=1)
    assert calls and _rel(eager, ref) > 0.01
    clone, _ = apply_compile(m, CompileConfig(separate_process=False))
    out = _sample(clone, steps=1)
    assert _rel(out, eager) < 0.02 < _rel(out, ref), (_rel(out, eager), _rel(out, ref))


@pytest.mark.fresh_compile  # the error came from dynamo's trace, which a loaded package skips
def test_comfyuis_cpu_attention_is_replaced_by_sdpa_in_the_compiled_model(tiny_flux, counters, monkeypatch, caplog):
    """ComfyUI started with --cpu alone runs sub-quadratic attention, which reads free memory inside the model: under
    block regions dynamo raised a raw UncapturedHigherOrderOpError. The compiled clone runs PyTorch SDPA instead
    (what --use-pytorch-cross-attention selects) and says so; the eager model keeps ComfyUI's attention."""
    import comfy.ldm.flux.math as fm
    import comfy.ldm.modules.attention as attn
    from fluxaccel.core.patches import describe

    ref = _sample(tiny_flux, steps=1)  # PyTorch attention (the test host's choice, tools/host.py)
    monkeypatch.setattr(fm, "optimized_attention", attn.wrap_attn(attn.attention_sub_quad))
    sub_quad = _sample(tiny_flux, steps=1)
    clone, c = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    with caplog.at_level("INFO", logger="fluxaccel.compile"):
        out = _sample(clone, steps=1)
    assert _rel(out, ref) < 0.02 and _rel(sub_quad, ref) < 0.02, (_rel(out, ref), _rel(sub_quad, ref))
    note = describe(clone)["compile"]["attention_note"]
    assert "attention_sub_quad" in note and "--use-pytorch-cross-attention" in note and note in caplog.text


def test_controlnet_residuals_reach_the_compiled_model(tmp_path):
    """ComfyUI's own ControlNet (core ControlNetApplyAdvanced, a FLUX ControlNet file ComfyUI loads) on the compiled
    model: the same latent as on the uncompiled one (float32), different from no control, every call compiled."""
    import comfy.controlnet
    import comfy.sample

    from support.models import build_flux, comfy_nodes, synthetic_conditioning, write_flux_controlnet

    nodes = comfy_nodes()

    base = build_flux("tiny", dtype=torch.float32)
    control = comfy.controlnet.load_controlnet(str(write_flux_controlnet(tmp_path / "cnet.safetensors")))
    hint = torch.rand(1, 128, 128, 3, generator=torch.Generator().manual_seed(5))

    def run(model, with_control=True):
        pos, neg = synthetic_conditioning("tiny", text_len=16), synthetic_conditioning("tiny", text_len=16, seed=100)
        if with_control:
            pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control, hint, 0.8, 0.0, 1.0)
        latent = torch.zeros(1, 16, 16, 16)
        return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 0), 3, 2.0, "euler", "simple", pos, neg,
                                   latent, disable_pbar=True, seed=0)

    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", separate_process=False))
    out, eager = run(model), run(base)
    assert rel_err(out, eager) < 1e-4
    assert rel_err(eager, run(base, with_control=False)) > 1e-2  # the control changes the image
    assert compiled.stats.calls == 3 and compiled.stats.eager_calls == 0


def test_a_lora_strength_change_reuses_the_compiled_model(cpu_fp8, tiny_flux, counters):
    """LoraLoaderModelOnly -> Quantize FP8 -> Compile, strength 1.0 then 0.5 (ComfyUI's own LoRA loading): the second
    Compile shares the first's compiled blocks and CUDA graphs (nothing compiled again: dynamo's counters), the FP8
    Linears are the same buffers merged in place, and the image is the one a fresh quantize and compile of the 0.5
    clone gives."""
    from fluxaccel.core.compile import patch
    from fluxaccel.core.quant import store
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from support.models import lora_state_dict, with_lora
    from support.runs import sample

    targets = ["double_blocks.0.img_attn.qkv", "double_blocks.1.img_mlp.0", "single_blocks.0.linear1",
               "double_blocks.0.img_mod.lin"]
    sd = lora_state_dict(tiny_flux, targets)
    cfg = CompileConfig(separate_process=False)

    def chain(strength):
        return apply_compile(apply_fp8(with_lora(tiny_flux, sd, strength), Fp8Config())[0], cfg)

    full, c_full = chain(1.0)
    out_full = sample(full, steps=2)
    graphs, merges = compiled_graphs(), owner_of(full).merges
    half, c_half = chain(0.5)
    assert c_half.runner is c_full.runner and c_half.stats.calls == 0
    out_half = sample(half, steps=2)
    assert compiled_graphs() == graphs and c_half.stats.eager_calls == 0
    assert owner_of(full).merges == merges + 3  # the three FP8 Linears the LoRA patches
    assert rel_err(out_half, out_full) > 1e-3
    tiny_flux.model.__dict__.pop(store.SETS)  # quantized and compiled afresh: the reference
    patch._COMPILED.clear()
    fresh, _ = chain(0.5)
    assert torch.equal(sample(fresh, steps=2), out_half)


@pytest.mark.parametrize("change", ["swap", "stack", "remove"])
def test_a_lora_swap_stack_or_removal_reuses_the_compiled_model_in_place(cpu_fp8, tiny_flux, counters, change):
    """LoRA A, then (swap) LoRA B instead, (stack) A and B chained, or (remove) none, each -> Quantize FP8 ->
    Compile: nothing compiled again (dynamo's counters), the FP8 Linears keep their buffers (data pointers), and
    the image equals a fresh quantize and compile of that chain."""
    from fluxaccel.core.compile import patch
    from fluxaccel.core.quant import store
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from support.models import lora_state_dict, with_lora
    from support.runs import sample

    a = lora_state_dict(tiny_flux, ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"], seed=1)
    b = lora_state_dict(tiny_flux, ["double_blocks.1.txt_mlp.0", "single_blocks.1.linear2"], seed=2)
    cfg = CompileConfig(separate_process=False)
    loras = {"swap": lambda m: with_lora(m, b, 0.8), "stack": lambda m: with_lora(with_lora(m, a, 1.0), b, 0.8),
             "remove": lambda m: m}[change]

    def chain(loaded):
        return apply_compile(apply_fp8(loaded, Fp8Config())[0], cfg)

    first, c_first = chain(with_lora(tiny_flux, a, 1.0))
    out_first = sample(first, steps=2)
    linears = owner_of(first).fp8
    pointers = {n: (m.weight.data_ptr(), m.fp8_weight_scale.data_ptr()) for n, m in linears.items()}
    graphs = compiled_graphs()
    then, c_then = chain(loras(tiny_flux))
    out_then = sample(then, steps=2)
    assert c_then.runner is c_first.runner and compiled_graphs() == graphs and c_then.stats.eager_calls == 0
    assert {n: (m.weight.data_ptr(), m.fp8_weight_scale.data_ptr()) for n, m in linears.items()} == pointers
    assert rel_err(out_then, out_first) > 1e-3
    tiny_flux.model.__dict__.pop(store.SETS)  # quantized and compiled afresh: the reference
    patch._COMPILED.clear()
    fresh, _ = chain(loras(tiny_flux))
    assert torch.equal(sample(fresh, steps=2), out_then)


def test_kept_fp8_linears_and_compiled_models_go_with_their_loaded_model(cpu_fp8):
    """The FP8 Linears and compiled models kept for a loaded model's later clones hold no reference to it: when
    ComfyUI drops the model, they go too."""
    import gc
    import weakref

    from fluxaccel.core.compile import patch
    from fluxaccel.core.quant import store
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from support.models import build_flux

    base = build_flux("tiny")
    model, _ = apply_compile(apply_fp8(base, Fp8Config())[0], CompileConfig(separate_process=False))
    gone = weakref.ref(base.model)
    assert store.SETS in vars(gone()) and gone() in patch._COMPILED
    del base, model
    gc.collect()
    assert gone() is None


def test_a_new_shape_that_does_not_fit_free_memory_is_refused_before_anything_compiles(tiny_flux, counters):
    """A model call at latent 512x512 (65,536 image tokens): on the CPU its attention alone needs more than this
    machine's free memory, by ComfyUI's own figure. It is refused naming the Compile node and the shape, before any
    compile or capture; the model stays as it was and its compiled shape still runs."""
    import comfy.model_management as mm

    from fluxaccel.core.budget import call_bytes

    clone, compiled = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, separate_process=False))
    _denoise_once(clone, hw=8)
    need = call_bytes(tiny_flux.model.diffusion_model, 256 * 256 + 16, 1, 4, torch.device("cpu"))
    assert need > mm.get_free_memory(torch.device("cpu")), "the shape must not fit this machine"
    graphs = compiled_graphs()
    with pytest.raises(FluxAccelError, match=r"Compile \+ CUDA Graph \(FluxAccel\): a model call at batch 1, latent "
                                             r"512x512 \(4096x4096 px\).* needs about [\d.]+ GiB on cpu, which has"):
        _denoise_once(clone, hw=512)
    assert compiled_graphs() == graphs and [k.height for k in compiled.stats.shapes] == [8]
    _denoise_once(clone, hw=8)
    assert compiled.stats.eager_calls == 0
