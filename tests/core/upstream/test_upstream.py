"""core/upstream: each adapter function with the upstream name it reads removed or renamed. The function answers
"not available" (no AttributeError/ImportError), the log says once what is missing and what FluxAccel does instead,
and the nodes still run -- or refuse with a message that says what to do.

ComfyUI and torchao names are deleted from the real modules (monkeypatch.delattr). torch's dynamo/inductor names are
hidden from the adapter's lookup instead (`hide`): torch's own compiler keeps using them while it compiles.
"""
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from fluxaccel.core import upstream
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.upstream import Unavailable, comfy_internals, torch_internals, torchao_internals
from support.runs import denoise_once
from fluxaccel.core.bench.metrics import rel_err


@pytest.fixture(autouse=True)
def _fresh_said():
    upstream.forget()
    yield
    upstream.forget()


def hide(monkeypatch, *paths):
    """torch names (dotted, below torch) that the adapter's lookup no longer finds, as if torch renamed them."""
    real = torch_internals._attr
    monkeypatch.setattr(torch_internals, "_attr", lambda p: torch_internals._missing(p) if p in paths else real(p))


def said(caplog, *words) -> bool:
    return any(all(w in r.getMessage() for w in words) for r in caplog.records if r.name == "fluxaccel.upstream")


# -- ComfyUI ----------------------------------------------------------------------------------------------------------
def test_core_graph_modules_without_core_registries(monkeypatch, tiny_flux, caplog):
    import comfy.model_prefetch as prefetch

    for name in ("GRAPH_MODULES", "GRAPH_WARMED_MODULES"):
        if hasattr(prefetch, name):
            monkeypatch.delattr(prefetch, name)
    dm = tiny_flux.model.diffusion_model
    assert comfy_internals.core_graph_modules(dm) == []
    assert said(caplog, "GRAPH_WARMED_MODULES", "only captured ones are checked")
    monkeypatch.setattr(dm.double_blocks[0], "_comfy_graph", {"graph": None}, raising=False)
    assert comfy_internals.core_graph_modules(dm) == ["diffusion_model.double_blocks.0"]
    with pytest.raises(FluxAccelError, match="per-block CUDA graph on diffusion_model.double_blocks.0"):
        apply_compile(tiny_flux, CompileConfig(separate_process=False))


def test_model_compiler_state_without_its_registry(monkeypatch):
    import comfy.model_prefetch as prefetch

    monkeypatch.setattr(prefetch, "malloc_graph_begin", lambda device: None, raising=False)  # a compiler is there
    if hasattr(prefetch, "MALLOC_GRAPHS"):
        monkeypatch.delattr(prefetch, "MALLOC_GRAPHS")
    state = comfy_internals.model_compiler_recording()
    assert isinstance(state, Unavailable) and "MALLOC_GRAPHS" in str(state)


def test_compiled_model_runs_with_comfy_internals_missing(monkeypatch, tiny_flux, caplog):
    """No pause_malloc_graph while a recording is active, and no plain RoPE formula: the compiled model still runs,
    equal to eager within float tolerance; each missing name is said once, the unknown compiler state counted."""
    import comfy.ldm.flux.math as fm
    import comfy.model_prefetch as prefetch

    ref = denoise_once(tiny_flux, hw=8)
    events = []
    rec = SimpleNamespace(_comfy_active=True, pause=lambda sync=False: events.append("pause"),
                          resume=lambda sync=False: events.append("resume"))
    monkeypatch.setattr(prefetch, "MALLOC_GRAPHS", {threading.get_ident(): rec}, raising=False)
    if hasattr(prefetch, "pause_malloc_graph"):
        monkeypatch.delattr(prefetch, "pause_malloc_graph")
    if hasattr(fm, "_apply_rope1"):
        monkeypatch.delattr(fm, "_apply_rope1")
    clone, compiled = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, separate_process=False))
    out = denoise_once(clone, hw=8)
    assert rel_err(out, ref) < 2e-2
    assert compiled.stats.model_compiler_unknown == compiled.stats.calls >= 1 and events == []
    assert said(caplog, "pause_malloc_graph", "--disable-comfy-compiler")
    from fluxaccel.core.patches import describe

    shown = describe(clone)
    assert shown["compile"]["model_compiler_unknown_calls"] == compiled.stats.calls
    assert any("pause_malloc_graph" in d and "--disable-comfy-compiler" in d for d in shown["degradations"])
    if comfy_internals.flux_plain_rope1() is not None:  # ComfyUI with kitchen RoPE (0.33+)
        assert said(caplog, "_apply_rope1", "comfy-kitchen's RoPE op")


def test_resident_copy_names_missing(monkeypatch, tiny_flux):
    """The dynamic model's kept delegate, its backup shapes and ComfyUI's unload: each answers "not available"."""
    import comfy.model_management
    import comfy.model_patcher

    assert isinstance(comfy_internals.kept_delegate(tiny_flux), Unavailable)  # a plain patcher keeps none
    assert isinstance(comfy_internals.keep_delegate(tiny_flux, (tiny_flux.model, ())), Unavailable)
    monkeypatch.delattr(comfy.model_patcher.ModelPatcher, "get_clone_model_override")
    assert isinstance(comfy_internals.delegate_override(tiny_flux, tiny_flux.model), Unavailable)
    monkeypatch.delattr(comfy.model_management, "unload_model_and_clones", raising=False)
    missing = comfy_internals.unload_model_and_clones(tiny_flux)
    assert isinstance(missing, Unavailable) and "unload_model_and_clones" in str(missing)
    assert "model_loaded_weight_memory" in comfy_internals.patcher_model_state(tiny_flux.model)


LORA_LINEAR = "double_blocks.0.img_attn.qkv"


def _lora_weight(model, strength: float):
    """(a clone of `model` with a LoRA on LORA_LINEAR as LoraLoaderModelOnly makes it, the weight's key)."""
    from support.models import lora_state_dict, with_lora

    return with_lora(model, lora_state_dict(model, [LORA_LINEAR]), strength), f"diffusion_model.{LORA_LINEAR}.weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_weight_is_comfyuis_patch_weight_to_device(dtype):
    """The weight with its LoRA as FluxAccel merges it equals, bit for bit, what ComfyUI's own
    ModelPatcher.patch_weight_to_device returns for it (bf16: ComfyUI's stochastic rounding with the key's seed)."""
    from support.models import build_flux

    base = build_flux("tiny", dtype=dtype)
    lora, key = _lora_weight(base, 0.7)
    stored = base.model.diffusion_model.get_submodule(LORA_LINEAR).weight
    ours = comfy_internals.patched_weight(lora.patches[key], key, stored, torch.device("cpu"))
    theirs = lora.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    assert not torch.equal(ours, stored) and not lora.backup  # the LoRA counts; the model was not patched


@pytest.mark.parametrize("name", ["comfy.float.stochastic_rounding", "comfy.lora.calculate_weight",
                                  "comfy.model_management.lora_compute_dtype"])
def test_patched_weight_missing_refuses_the_fp8_merge_naming_it(monkeypatch, tiny_flux, name):
    import importlib

    from fluxaccel.core.quant import source

    where, attr = name.rsplit(".", 1)
    monkeypatch.delattr(importlib.import_module(where), attr)
    lora, key = _lora_weight(tiny_flux, 1.0)
    stored = tiny_flux.model.diffusion_model.get_submodule(LORA_LINEAR).weight
    missing = comfy_internals.patched_weight(lora.patches[key], key, stored, torch.device("cpu"))
    assert isinstance(missing, Unavailable) and attr in str(missing)
    with pytest.raises(FluxAccelError, match="LoRAs cannot be merged into FP8 weights here. Run without Quantize FP8"):
        source.patched(lora.patches[key], key, stored, torch.device("cpu"))


def test_interrupt_request_and_exception_or_missing(monkeypatch, caplog):
    """Cancel as ComfyUI's /interrupt sets it, and the exception that ends a prompt as cancelled; where this ComfyUI
    has neither: "not available" and KeyboardInterrupt, each said."""
    import comfy.model_management as mm

    mm.interrupt_current_processing(True)
    try:
        assert comfy_internals.interrupt_requested() is True
    finally:
        mm.interrupt_current_processing(False)
    assert comfy_internals.interrupt_requested() is False
    assert comfy_internals.interrupt_exception() is mm.InterruptProcessingException
    monkeypatch.delattr(mm, "processing_interrupted")
    monkeypatch.delattr(mm, "InterruptProcessingException")
    missing = comfy_internals.interrupt_requested()
    assert isinstance(missing, Unavailable) and "processing_interrupted" in str(missing)
    upstream.forget()
    with caplog.at_level(logging.WARNING, logger="fluxaccel.upstream"):
        assert comfy_internals.interrupt_exception() is KeyboardInterrupt
    assert said(caplog, "InterruptProcessingException", "KeyboardInterrupt")


def test_diffusion_model_wrappers_run_as_comfyui_runs_them_or_missing(monkeypatch):
    """A DIFFUSION_MODEL wrapper in transformer_options is found, taken out of a copy of them, and run around the
    inner function by ComfyUI's WrapperExecutor; without ComfyUI's lookup: "not available"."""
    import comfy.patcher_extension as ext

    order = []

    def wrapper(executor, *args, **kwargs):
        order.append("wrapper")
        return executor(*args, **kwargs) + 1

    options = {"wrappers": {ext.WrappersMP.DIFFUSION_MODEL: {"easycache": [wrapper]}, "other": {"x": [print]}}}
    found = comfy_internals.diffusion_model_wrappers(options)
    assert found == [wrapper]
    rest = comfy_internals.without_diffusion_model_wrappers(options)
    assert rest["wrappers"] == {"other": {"x": [print]}} and ext.WrappersMP.DIFFUSION_MODEL in options["wrappers"]
    assert comfy_internals.diffusion_model_wrappers(rest) == []
    inner = lambda x, scale=1: order.append("inner") or x * scale  # noqa: E731
    assert comfy_internals.run_wrapped(inner, object(), found, (3,), {"scale": 2}) == 7
    assert order == ["wrapper", "inner"]
    monkeypatch.delattr(ext, "get_all_wrappers")
    missing = comfy_internals.diffusion_model_wrappers(options)
    assert isinstance(missing, Unavailable) and "get_all_wrappers" in str(missing)


def test_source_file_missing(tiny_file_model):
    """A patcher without cached_patcher_init (a ComfyUI before it, or a custom patcher): no file to key the FP8
    weights cache by, said as such."""
    from fluxaccel.core.cache import fp8_weights as weights_cache
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.source import Linears

    from pathlib import Path

    assert isinstance(comfy_internals.source_file(tiny_file_model), Path)  # UNETLoader's loader registers it
    import comfy.model_patcher

    cpu = torch.device("cpu")
    bare = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), load_device=cpu, offload_device=cpu)
    bare.__dict__.pop("cached_patcher_init", None)  # the name missing, as before ComfyUI had it
    assert not hasattr(bare, "cached_patcher_init")
    missing = comfy_internals.source_file(bare)
    assert isinstance(missing, Unavailable) and "cached_patcher_init" in str(missing)
    assert comfy_internals.load_options(bare) == {}
    entry = weights_cache.entry_for(Linears(bare, {}, [], {}), Fp8Config())
    assert entry.key is None and "no weights file is known" in entry.why_not and "cached_patcher_init" in entry.why_not


@pytest.fixture
def tiny_file_model(tmp_path):
    import comfy.sd
    from support.models import write_flux_file
    from support.shapes import TINY

    path = write_flux_file(tmp_path / "tiny.safetensors", TINY)
    return comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16})


def test_checkpoint_qdata_missing():
    from fluxaccel.core.models.loaded import checkpoint_format

    got = comfy_internals.checkpoint_qdata(torch.zeros(2, 2))
    assert isinstance(got, Unavailable) and "_qdata" in str(got)
    assert checkpoint_format(torch.nn.Linear(2, 2)) == "quantized"


def test_rms_norm_weight_or_missing(tiny_flux):
    """The QK-norm's weight: ComfyUI's own RMSNorm keeps it in `weight`; an RMSNorm without it answers "not
    available" (FP8 attention then says why its bound is not used)."""
    from fluxaccel.core.compile import fp8_attention

    block = tiny_flux.model.diffusion_model.double_blocks[0]
    norm = block.img_attn.norm.query_norm
    own = comfy_internals.rms_norm_weight(norm)
    assert isinstance(own, torch.Tensor) and own is norm.weight
    got = comfy_internals.rms_norm_weight(torch.nn.Module())
    assert isinstance(got, Unavailable) and "RMSNorm.weight" in str(got)
    block.img_attn.norm.query_norm = torch.nn.Module()
    try:
        assert fp8_attention.qk_scales(block) is None
        assert "RMSNorm.weight" in fp8_attention.why_no_qk_bound(block)
    finally:
        block.img_attn.norm.query_norm = norm


# -- torch ------------------------------------------------------------------------------------------------------------
def test_mode_options_missing(monkeypatch):
    hide(monkeypatch, "torch._inductor.list_mode_options")
    assert isinstance(torch_internals.mode_options("max-autotune"), Unavailable)
    assert CompileConfig(mode="default").inductor_options(capture=False)["triton.cudagraphs"] is False
    with pytest.raises(FluxAccelError, match="mode 'max-autotune' cannot be expanded.*set mode to 'default'"):
        CompileConfig(mode="max-autotune").inductor_options(capture=False)


def test_dynamo_config_missing(monkeypatch, caplog):
    hide(monkeypatch, "torch._dynamo.config")
    with torch_internals.recompile_budget(1024):
        pass
    assert said(caplog, "recompile_limit", "past it a new shape runs uncompiled")
    with torch_internals.enable_aot_compile():
        pass
    assert torch_internals.dynamo_config_value("recompile_limit", "x") == "x"


def test_compile_facts_missing_say_cannot_tell(monkeypatch, tiny_flux, caplog):
    """Timers, OptimizedModule, the artifact manager: a compile still runs and writes its cache file (torch's public
    save_cache_artifacts), and what cannot be told is said, never guessed."""
    from fluxaccel.core.compile import telemetry as cc
    from fluxaccel.core.cache.kernels import KernelCache
    from fluxaccel.core.compile.progress import UNKNOWN_PHASE, phase, _counts

    hide(monkeypatch, "torch._dynamo.utils.compilation_time_metrics", "torch._dynamo.eval_frame.OptimizedModule",
         "torch.compiler._cache.CacheArtifactManager")
    assert _counts() is None and phase(_counts(), _counts()) == UNKNOWN_PHASE and cc.phase_totals() == {}
    assert torch_internals.is_compiled_module(torch.nn.Linear(2, 2)) is False
    assert isinstance(torch_internals.per_compile_artifacts(), Unavailable)
    clone, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    ref = denoise_once(tiny_flux, hw=8)
    out = denoise_once(clone, hw=8)
    assert rel_err(out, ref) < 2e-2 and compiled.stats.compile_seconds
    assert compiled.cache.path.is_file() and KernelCache(compiled.cache.key, compiled.cache.dir).load()
    for words in (("compilation_time_metrics", "not split by phase"), ("OptimizedModule", "not recognised"),
                  ("CacheArtifactManager", "every artifact this process compiled")):
        assert said(caplog, *words), words


def test_inductor_config_missing_keeps_package_loads_in_the_first_call(monkeypatch, tmp_path):
    hide(monkeypatch, "torch._inductor.config.triton.cudagraphs")
    assert isinstance(torch_internals.inductor_config_differs({"triton.cudagraphs": False}), Unavailable)
    from fluxaccel.core.cache.packages import Packages, WarmStart

    store = WarmStart("k" * 32, tmp_path)
    store.path("s" * 16).write_bytes(b"x")
    packages = Packages(store, {"triton.cudagraphs": False})
    assert "load at the first model call" in packages.prefetch(4, torch.device("cpu")) and not packages.pending


@pytest.mark.parametrize("name", ["torch._inductor.virtualized.V", "torch._inductor.runtime.hints.ReductionHint"])
def test_choices_handler_missing_leaves_inductors_reductions(monkeypatch, caplog, name):
    from torch._inductor.virtualized import V

    from fluxaccel.core.compile import reductions

    hide(monkeypatch, name)
    before = type(V.choices)
    with reductions.persistent():
        assert type(V.choices) is before and torch.compiler.config.cache_key_tag == ""
    assert said(caplog, name, "reductions compile as inductor decides")


def test_cache_tag_missing_says_caches_may_mix(monkeypatch, caplog):
    from torch._inductor.virtualized import V

    from fluxaccel.core.compile import reductions

    hide(monkeypatch, "torch.compiler.config")
    before = type(V.choices)
    with reductions.persistent():
        assert type(V.choices) is not before  # the choice still applies
    assert said(caplog, "cache_key_tag", "may hand out kernels of the same graph")


def test_aot_compile_missing(monkeypatch, tiny_flux):
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    from fluxaccel.core.cache import packages as warm_start

    ok, why = warm_start.available()
    assert not ok and "load_compiled_function" in why
    _, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    assert compiled.packages is None and "load_compiled_function" in compiled.stats.warm_start_off


# -- torchao ----------------------------------------------------------------------------------------------------------
def test_fp8_gate_missing_refuses_fp8_off_the_gpu(monkeypatch, tiny_flux, caplog):
    import torchao.quantization.quant_api as qa

    from fluxaccel.core.env import torchao_fp8_here
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    monkeypatch.delattr(qa, "_check_hardware_support")
    assert isinstance(torchao_internals.fp8_gate_open(), Unavailable) and torchao_fp8_here() is False
    assert said(caplog, "_check_hardware_support", "FP8 is refused off the GPU")
    with pytest.raises(FluxAccelError, match="FP8 quantization runs on NVIDIA GPUs"):
        apply_fp8(tiny_flux, Fp8Config())


def test_kernel_preference_missing(monkeypatch, caplog):
    import importlib

    from fluxaccel.core.quant.fp8 import Fp8Config

    common = importlib.import_module("torchao.quantization.quantize_.common")

    monkeypatch.delattr(common, "KernelPreference")
    assert isinstance(torchao_internals.torch_kernel_preference(), Unavailable)
    with caplog.at_level(logging.INFO, logger="fluxaccel.upstream"):
        cfg = Fp8Config().torchao_config()
    assert cfg.granularity is not None and said(caplog, "KernelPreference", "may round differently")


def test_float8_primitives_missing_refuse_fp8_with_what_to_install(monkeypatch, tiny_flux, cpu_fp8):
    import torchao.quantization.quant_primitives as qp

    from fluxaccel.core.quant import fp8
    from fluxaccel.core.quant.patch import apply_fp8

    monkeypatch.delattr(qp, "_choose_scale_float8")
    monkeypatch.setattr(fp8, "_AO", None)
    assert isinstance(torchao_internals.float8_primitives(), Unavailable)
    with pytest.raises(FluxAccelError, match="_choose_scale_float8.*Install torchao 0.17 or 0.18"):
        apply_fp8(tiny_flux, fp8.Fp8Config())


def test_shapes_are_read_with_comfy_aimdo_on(monkeypatch):
    """Under comfy-aimdo (dynamic VRAM) ComfyUI's Linear defers its weight to the state-dict load: the synthetic
    models still see every parameter (eager_init_ops), as without it."""
    import comfy.memory_management

    from fluxaccel.core.models import synthetic

    without = synthetic.param_count("e2e-flux2")
    keys = [k for k, _ in synthetic.random_state_dict("e2e-flux2")]
    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    assert synthetic.param_count("e2e-flux2") == without > 0
    assert [k for k, _ in synthetic.random_state_dict("e2e-flux2")] == keys
    import comfy.ops

    with torch.device("meta"):
        assert comfy.ops.disable_weight_init.Linear(16, 16).weight is None  # what ComfyUI's own op does then


def test_linear_copy_without_modules_tables(monkeypatch, caplog):
    """Quantize FP8's per-Linear copy on a torch whose nn.Module keeps its tables elsewhere: a whole copy instead,
    said once; with the tables, a copy of its own tables sharing the weight."""
    import copy

    from fluxaccel.core.quant.linear import detached_copy

    lin = torch.nn.Linear(4, 4)
    shallow = torch_internals.module_shallow_copy(lin)
    shallow.register_buffer("extra", torch.zeros(1))
    assert shallow.weight is lin.weight and "extra" not in lin._buffers
    buffers = lin.__dict__.pop("_buffers")
    try:
        assert isinstance(torch_internals.module_shallow_copy(lin), Unavailable)
    finally:
        lin.__dict__["_buffers"] = buffers
    real, whole = copy.deepcopy, []
    monkeypatch.setattr(torch_internals, "module_shallow_copy", lambda m: torch_internals._missing("nn.Module._buffers"))
    monkeypatch.setattr(copy, "deepcopy", lambda m, *a: whole.append(m) or real(m, *a))
    new = detached_copy(lin, torch.device("cpu"))
    assert whole == [lin] and torch.equal(new.weight, lin.weight) and new.weight is not lin.weight
    assert said(caplog, "nn.Module._buffers", "copies each Linear whole")


def test_share_module_tree_without_modules_tables(tiny_flux):
    """A torch whose nn.Module keeps its parameters elsewhere: no shared copy (the caller then reloads, and says so)."""
    dm = tiny_flux.model.diffusion_model
    copy = torch_internals.share_module_tree(dm)
    assert copy is not dm and all(a.data_ptr() == b.data_ptr() for a, b in zip(copy.parameters(), dm.parameters()))
    block = dm.double_blocks[0]
    buffers = block.__dict__.pop("_buffers")
    try:
        missing = torch_internals.share_module_tree(dm)
        assert isinstance(missing, Unavailable) and "_buffers" in str(missing)
    finally:
        block.__dict__["_buffers"] = buffers


def test_module_tensors_reads_the_tables_and_walks_publicly_without_them(monkeypatch, tiny_flux):
    """What a captured call checks before each replay: every weight and buffer of the tree, from nn.Module's tables;
    the public walk where a torch keeps them under other names."""
    dm = tiny_flux.model.diffusion_model
    public = [t for t in (*dm.parameters(), *dm.buffers()) if t is not None]
    fast = torch_internals.module_tensors(dm)
    assert len(fast) == len(public) > 20 and {id(t) for t in fast} == {id(t) for t in public}
    monkeypatch.setattr(torch_internals, "_TABLES", ("_parameters_v2", "_buffers", "_modules"))
    assert [id(t) for t in torch_internals.module_tensors(dm)] == [id(t) for t in public]


def test_pin_host_missing_says_so(monkeypatch):
    buf = torch.empty(16, dtype=torch.uint8)
    hide(monkeypatch, "torch.cuda.cudart")
    assert isinstance(torch_internals.pin_host(buf), Unavailable)
    monkeypatch.undo()
    if not torch.cuda.is_available():  # a CPU build: no CUDA runtime to lock pages with, said as such
        assert isinstance(torch_internals.pin_host(buf), Unavailable)


def test_fa3_forward_missing_says_what_and_fp8_attention_explains(monkeypatch):
    """Without the fa3-fwd wheel (these machines): Unavailable naming its interface; with an interface that registers
    no such op: Unavailable naming the op. Either way the Compile node's refusal says what to install."""
    import sys
    import types

    from fluxaccel.core.compile import fp8_attention
    from fluxaccel.core.upstream import fa3_internals

    missing = fa3_internals.available()
    assert isinstance(missing, Unavailable) and missing.name == "fa3_fwd_interface" and missing.upstream == "fa3-fwd"
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", types.ModuleType("fa3_fwd_interface"))
    monkeypatch.setattr(fa3_internals, "NAMESPACE", "fa3_fwd_renamed")
    no_op = fa3_internals.available()
    assert isinstance(no_op, Unavailable) and no_op.name == "torch.ops.fa3_fwd_renamed._flash_attn_forward"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = fp8_attention.why_not(torch.device("cuda"))
    assert "has no torch.ops.fa3_fwd_renamed._flash_attn_forward" in why and "pip install fa3-fwd" in why


def test_launch_args_missing(monkeypatch):
    """ComfyUI's parsed launch flags (copied into a separate compile process): without them both directions say so,
    and the separate compile is refused (tests/core/compile/test_separate.py)."""
    import comfy.cli_args
    import comfy.model_management  # noqa: F401  (reads the flags at import: before they go missing)

    flags = comfy_internals.launch_args()
    assert isinstance(flags, dict) and "listen" in flags
    assert comfy_internals.set_launch_args({"listen": flags["listen"]}) is True
    monkeypatch.delattr(comfy.cli_args, "args")
    assert isinstance(comfy_internals.launch_args(), Unavailable)
    missing = comfy_internals.set_launch_args({"listen": "x"})
    assert isinstance(missing, Unavailable) and "comfy.cli_args.args" in str(missing)


def test_cpp_compiler_lookup_missing(monkeypatch):
    """Where torch no longer has inductor's compiler lookup, FluxAccel cannot tell whether the C++ wrapper builds:
    calls are then not captured, said why (not captured on a guess)."""
    from fluxaccel.core.compile import patch

    hide(monkeypatch, "torch._inductor.cpp_builder.get_cpp_compiler")
    assert isinstance(torch_internals.cpp_compiler(), Unavailable)
    why = patch.capture_unavailable(torch.device("cuda"))
    assert "cpp_builder.get_cpp_compiler" in why and "cannot be checked" in why


def test_vec_isa_list_kept_drops_what_fluxaccel_computed(monkeypatch):
    """The CPU vector-ISA list inductor computes inside FluxAccel's compile (cpp.vec_isa_ok off for GPU code) is not
    kept for the process; one computed before is left as it was. (What the list holds is torch's: its ISA objects
    cache their own answer per process, so only whether the list is kept is FluxAccel's to check.)"""
    import torch._inductor.config as ic
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    try:
        with torch_internals.vec_isa_list_kept(), ic.patch({"cpp.vec_isa_ok": False}):
            cpu_vec_isa.valid_vec_isa_list()
            assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
        before = cpu_vec_isa.valid_vec_isa_list()  # computed before: the process's own list
        with torch_internals.vec_isa_list_kept(), ic.patch({"cpp.vec_isa_ok": False}):
            assert cpu_vec_isa.valid_vec_isa_list() is before
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1 and cpu_vec_isa.valid_vec_isa_list() is before
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_vec_isa_list_missing(monkeypatch, caplog):
    """Where torch has no such list (or no cache on it), the body runs as it is and the log says what stays."""
    hide(monkeypatch, "torch._inductor.cpu_vec_isa.valid_vec_isa_list")
    ran = []
    with caplog.at_level(logging.INFO, logger="fluxaccel.upstream"):
        with torch_internals.vec_isa_list_kept():
            ran.append(1)
    assert ran == [1] and said(caplog, "valid_vec_isa_list", "stays in inductor's cache")


def test_import_inductor_names_the_modules_this_torch_lacks(monkeypatch):
    monkeypatch.setattr(torch_internals, "INDUCTOR_MODULES", ("torch._inductor.choices", "torch._inductor.not_here"))
    assert torch_internals.import_inductor() == ["torch._inductor.not_here"]
    import sys

    assert "torch._inductor.choices" in sys.modules


def test_hooked_weight_is_comfyuis_patch_hook_weight_to_device():
    """A hook LoRA's patches on top of a weight, as FluxAccel merges them into an FP8 Linear, equal bit for bit the
    weight ComfyUI's own patch_hook_weight_to_device writes (bf16: its stochastic rounding with the key's seed)."""
    import comfy.hooks

    from support.models import build_flux, lora_state_dict

    base = build_flux("tiny")
    key = f"diffusion_model.{LORA_LINEAR}.weight"
    stored = base.model.diffusion_model.get_submodule(LORA_LINEAR).weight.detach().clone()
    hooks = comfy.hooks.create_hook_lora(lora=lora_state_dict(base, [LORA_LINEAR]), strength_model=0.8,
                                         strength_clip=0.0)
    clone = base.clone()
    clone.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
    combined = clone.get_combined_hook_patches(hooks=hooks)
    ours = comfy_internals.hooked_weight(combined[key], key, stored, stored, torch.device("cpu"))
    clone.patch_hooks(hooks)
    theirs = clone.model.diffusion_model.get_submodule(LORA_LINEAR).weight
    assert torch.equal(ours, theirs) and not torch.equal(ours, stored)
    clone.unpatch_hooks()


@pytest.mark.parametrize("name", ["comfy.lora.calculate_weight", "comfy.float.stochastic_rounding"])
def test_hooked_weight_missing_refuses_the_fp8_hook_naming_it(monkeypatch, tiny_flux, name):
    import importlib

    from fluxaccel.core.quant.store import _hooked

    where, attr = name.rsplit(".", 1)
    monkeypatch.delattr(importlib.import_module(where), attr)
    w = tiny_flux.model.diffusion_model.get_submodule(LORA_LINEAR).weight
    missing = comfy_internals.hooked_weight([], "k", w, w, torch.device("cpu"))
    assert isinstance(missing, Unavailable) and attr in str(missing)
    with pytest.raises(FluxAccelError, match="hook LoRAs cannot be merged into FP8 weights here"):
        _hooked([], "k", w, w, torch.device("cpu"))


def test_hook_cache_mode_missing(monkeypatch, tiny_flux):
    import comfy.hooks

    assert comfy_internals.hooks_cached(tiny_flux) is True  # 0.33's default: MaxSpeed
    monkeypatch.delattr(comfy.hooks, "EnumHookMode")
    assert isinstance(comfy_internals.hooks_cached(tiny_flux), Unavailable)
