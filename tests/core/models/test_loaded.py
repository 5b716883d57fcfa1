"""core/models/loaded.py and resident.py against ComfyUI 0.33's real classes: dynamic VRAM's non-dynamic delegate,
core's per-block CUDA-graph registry.

ModelPatcherDynamic cannot be constructed on a CPU machine as it is (its __new__ returns a plain ModelPatcher for CPU
load devices, and its __init__ needs comfy-aimdo's native library): `support.models.dynamic_patcher` builds the real
class with just those two parts left out, so is_dynamic(), clone() (a LoRA node's clone is dynamic too),
clone(disable_dynamic=True) and get_non_dynamic_delegate() are 0.33's code (its reload of the file goes through the
real comfy.sd.load_diffusion_model where FluxAccel cannot share the weights).
"""
import pytest
import torch

from fluxaccel.core.models import loaded as comfy_compat
from fluxaccel.core.models import resident
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import FP8_KEY, apply_fp8
from support.models import dynamic_patcher
from support.runs import denoise_once



def test_plain_models_are_used_as_they_are(tiny_flux):
    assert not comfy_compat.is_dynamic(tiny_flux)
    assert comfy_compat.resident(tiny_flux, "node") is tiny_flux


def test_dynamic_model_is_quantized_on_its_resident_delegate(cpu_fp8, e2e_model_file):
    dyn = dynamic_patcher(e2e_model_file)
    assert comfy_compat.is_dynamic(dyn)
    live = {n: m.weight for n, m in dyn.model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)}
    fp8, report = apply_fp8(dyn, Fp8Config())
    assert not fp8.is_dynamic() and fp8.model is not dyn.model  # the resident copy, over the same storage
    assert resident.shares_weights(fp8.model, dyn.model)
    assert report.quantized and fp8.get_attachment(FP8_KEY) and dyn.get_attachment(FP8_KEY) is None
    assert not dyn.object_patches  # the dynamic model (other branches) is untouched
    assert all(m.weight is live[n] for n, m in dyn.model.diffusion_model.named_modules() if n in live)
    again, _ = apply_fp8(dyn, Fp8Config(granularity="per_tensor"))
    assert again.model is fp8.model  # the delegate is kept by the dynamic patcher: no third copy
    # the same numbers as quantizing the plain (non-dynamic) load of the same file
    import comfy.sd

    ref, _ = apply_fp8(comfy.sd.load_diffusion_model(str(e2e_model_file), model_options={"dtype": torch.bfloat16}), Fp8Config())
    assert torch.equal(denoise_once(fp8, hw=8), denoise_once(ref, hw=8))


def test_dynamic_model_is_compiled_on_its_resident_delegate(e2e_model_file):
    dyn = dynamic_patcher(e2e_model_file)
    clone, compiled = apply_compile(dyn, CompileConfig(separate_process=False))
    assert not clone.is_dynamic() and clone.model is not dyn.model and compiled_of(clone) is compiled
    assert compiled_of(dyn) is None and compiled._dm is clone.model.diffusion_model


def test_resident_copy_shares_the_dynamic_models_weights(e2e_model_file):
    """No second host copy: the resident model's parameters hold the dynamic model's storage, in new module and
    parameter objects, without what dynamic loading leaves on modules; changing the copy leaves the original as it
    was, and the copy computes what the original does."""
    dyn = dynamic_patcher(e2e_model_file)
    lin = dyn.model.diffusion_model.double_blocks[0].img_attn.qkv
    lin._v, lin._pin_state, lin.seed_key, lin.comfy_cast_weights = object(), {}, "x", True  # as 0.33's dynamic load
    before = {n: p.detach().clone() for n, p in dyn.model.named_parameters()}
    res = comfy_compat.resident(dyn, "node")
    assert not res.is_dynamic() and res.model is not dyn.model and resident.shares_weights(res.model, dyn.model)
    copied = res.model.diffusion_model.double_blocks[0].img_attn.qkv
    assert copied is not lin and copied.weight is not lin.weight
    assert not any(hasattr(copied, a) for a in ("_v", "_pin_state", "seed_key"))
    assert "comfy_cast_weights" not in vars(copied)  # the class default of a plain load applies
    assert not any(k.startswith("dynamic_") for k in vars(res.model))
    assert comfy_compat.resident(dyn, "node").model is res.model  # kept: built once per dynamic patcher
    import comfy.sd

    plain = comfy.sd.load_diffusion_model(str(e2e_model_file), model_options={"dtype": torch.bfloat16})
    assert torch.equal(denoise_once(res, hw=8), denoise_once(plain, hw=8))
    res.model.to(torch.float16)  # what a move to another device or dtype does to the copy
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[n]) for n, p in dyn.model.named_parameters())


def test_dynamic_model_without_a_file_to_reload_is_shared(cpu_fp8, e2e_model_file):
    """A loader that registered no cached_patcher_init (e.g. weights built in memory): the shared copy needs none."""
    dyn = dynamic_patcher(e2e_model_file, with_init=False)
    fp8, report = apply_fp8(dyn, Fp8Config())
    assert report.quantized and resident.shares_weights(fp8.model, dyn.model)


def _not_as_stored(dyn, monkeypatch):
    """A dynamic model whose weights are elsewhere (one on another device, as a load for another branch leaves it)
    and a ComfyUI without the unload that would put them back."""
    import comfy.model_management

    monkeypatch.delattr(comfy.model_management, "unload_model_and_clones", raising=False)
    img_in = dyn.model.diffusion_model.img_in
    img_in.weight = torch.nn.Parameter(img_in.weight.to("meta"), requires_grad=False)
    return dyn


def test_where_the_weights_cannot_be_shared_comfyuis_reload_is_used_and_said(e2e_model_file, monkeypatch, caplog):
    from fluxaccel.core import upstream

    upstream.forget()
    dyn = _not_as_stored(dynamic_patcher(e2e_model_file), monkeypatch)
    with caplog.at_level("WARNING", "fluxaccel.upstream"):
        clone, compiled = apply_compile(dyn, CompileConfig(separate_process=False))
    assert clone.model is not dyn.model and not resident.shares_weights(clone.model, dyn.model)  # the file again
    assert clone.model.diffusion_model.img_in.weight.device.type == "cpu"
    assert any("unload_model_and_clones" in r.getMessage() and "second host copy" in r.getMessage()
               for r in caplog.records)
    upstream.forget()
    dyn = _not_as_stored(dynamic_patcher(e2e_model_file, with_init=False), monkeypatch)
    for apply in (lambda m: apply_fp8(m, Fp8Config()), lambda m: apply_compile(m, CompileConfig(separate_process=False))):
        with pytest.raises(FluxAccelError, match="dynamic VRAM.*UNETLoader.*--disable-dynamic-vram"):
            apply(dyn)
    upstream.forget()


def test_blocks_captured_by_core_cuda_graphs_are_refused(tiny_flux):
    import comfy.model_prefetch

    block = tiny_flux.model.diffusion_model.double_blocks[1]
    comfy.model_prefetch.GRAPH_WARMED_MODULES.add(block)  # what prefetch_queue_pop records before it captures
    try:
        assert comfy_compat.compiled_elsewhere(tiny_flux) == ["ComfyUI per-block CUDA graph on diffusion_model.double_blocks.1"]
        with pytest.raises(FluxAccelError, match="per-block CUDA graph on diffusion_model.double_blocks.1"):
            apply_compile(tiny_flux, CompileConfig(separate_process=False))
    finally:
        comfy.model_prefetch.GRAPH_WARMED_MODULES.discard(block)
    assert comfy_compat.compiled_elsewhere(tiny_flux) == []


def test_lora_changes_on_a_dynamic_model_find_its_resident_model_fp8_set_and_compiled_model(cpu_fp8, e2e_model_file):
    """Under ComfyUI's default dynamic VRAM, LoraLoaderModelOnly's clone of the loaded model is dynamic too, and every
    strength gives a new one: each resolves to the same resident model (one per dynamic model, with one set of patch
    backups), so Quantize FP8 finds the FP8 set of the clone before it (only the Linears the LoRA patches are merged
    again, in their buffers) and Compile its compiled model; ComfyUI then switches between them as between clones.
    Each image equals the same nodes on the plain load of the file (--disable-dynamic-vram)."""
    import comfy.sd

    from fluxaccel.core.models.patcher import owner_of
    from support.models import lora_state_dict, with_lora

    dyn = dynamic_patcher(e2e_model_file)
    plain = comfy.sd.load_diffusion_model(str(e2e_model_file), model_options={"dtype": torch.bfloat16})
    targets = ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"]
    sd = lora_state_dict(dyn, targets)
    cfg = CompileConfig(separate_process=False)

    def chain(loaded, strength):
        return apply_compile(apply_fp8(with_lora(loaded, sd, strength), Fp8Config())[0], cfg)

    assert with_lora(dyn, sd, 1.0).is_dynamic()  # ComfyUI's own LoRA loading keeps the class
    first, c_first = chain(dyn, 1.0)
    assert torch.equal(denoise_once(first, hw=8), denoise_once(chain(plain, 1.0)[0], hw=8))
    owner = owner_of(first)
    buffers = {n: (m.weight.data_ptr(), m.fp8_weight_scale.data_ptr()) for n, m in owner.fp8.items()}
    for strength in (0.5, 0.75, 0.0):
        then, c_then = chain(dyn, strength)
        assert then.model is first.model and owner_of(then) is owner and c_then.runner is c_first.runner
        merges = owner.merges
        out = denoise_once(then, hw=8)
        assert owner.merges == merges + len(targets)  # the two patched Linears, nothing else
        assert {n: (m.weight.data_ptr(), m.fp8_weight_scale.data_ptr()) for n, m in owner.fp8.items()} == buffers
        assert torch.equal(out, denoise_once(chain(plain, strength)[0], hw=8)), strength


def test_a_dropped_quantized_lora_clone_hands_its_load_to_the_dynamic_model_which_unloads(cpu_fp8, e2e_model_file):
    """A LoRA change drops the last prompt's clones: ComfyUI moves a dropped loaded clone's entry to its parent
    (LoadedModel._switch_parent), here the LoRA node's dynamic clone, and can then unload it as any other model; the
    dynamic model's weights are the file's again."""
    import gc

    import comfy.model_management as mm

    from support.models import lora_state_dict, with_lora

    dyn = dynamic_patcher(e2e_model_file)
    before = {k: v.clone() for k, v in dyn.model.state_dict().items()}
    q, _ = apply_fp8(with_lora(dyn, lora_state_dict(dyn, ["single_blocks.0.linear1"]), 1.0), Fp8Config())
    denoise_once(q, hw=8)
    del q
    gc.collect()
    assert [type(m.model).__name__ for m in mm.current_loaded_models] == ["CpuModelPatcherDynamic"]
    mm.unload_all_models()
    assert mm.current_loaded_models == []
    assert all(torch.equal(v, before[k]) for k, v in dyn.model.state_dict().items())
