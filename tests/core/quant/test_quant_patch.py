"""core/quant/patch.py: FP8 applied to a ModelPatcher clone through ComfyUI's real model management."""
import pytest
import torch

from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config, is_fp8_weight
from fluxaccel.core.quant.linear import is_fp8_linear
from fluxaccel.core.models.patcher import owner_of
from fluxaccel.core.quant.patch import FP8_KEY, apply_fp8, fp8_state, remove_fp8
from fluxaccel.core.bench.metrics import rel_err, sqnr_db
from fluxaccel.core.models import swaps
from support.runs import flux_inputs, forward, sample

# Whole tiny-FLUX forward vs bf16: see tests/core/quant/test_fp8.py for why 8% bounds FP8 e4m3 (SQNR >= 22 dB).
BOUND = 0.08


def _fp8_weights_in_tree(model) -> int:
    return sum(is_fp8_linear(m) for m in model.model.diffusion_model.modules())


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_whole_model_fidelity_and_branch_isolation(cpu_fp8, tiny_flux, granularity, compiled):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    ref = forward(tiny_flux, inputs)
    q, report = apply_fp8(tiny_flux, Fp8Config(granularity))
    assert q is not tiny_flux and len(report.quantized) == 20
    out = forward(q, inputs, compiled=compiled)
    assert _fp8_weights_in_tree(q) == 20, "the loaded clone must run the FP8 Linears"
    e = rel_err(out, ref)
    assert 0 < e < BOUND, f"{granularity}: rel err {e:.4f}, SQNR {sqnr_db(out, ref):.1f} dB"
    # The original patcher, loaded again after the FP8 clone, computes exactly what it did before.
    again = forward(tiny_flux, inputs)
    assert _fp8_weights_in_tree(tiny_flux) == 0
    assert torch.equal(again, ref)
    # ... and the FP8 clone, loaded once more, gives its own result again (patches re-applied).
    assert torch.equal(forward(q, inputs), forward(q, inputs))


def test_quantizing_twice_is_a_no_op(cpu_fp8, tiny_flux):
    q1, r1 = apply_fp8(tiny_flux, Fp8Config("per_row"))
    q2, r2 = apply_fp8(q1, Fp8Config("per_row"))
    assert q2 is q1 and r2.already_applied and "already applied" in r2.summary()
    assert q2.object_patches == q1.object_patches


def test_other_config_requantizes_from_bf16(cpu_fp8, tiny_flux):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    per_tensor_direct, _ = apply_fp8(tiny_flux, Fp8Config("per_tensor"))
    expected = forward(per_tensor_direct, inputs)
    per_row, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    forward(per_row, inputs)  # leave the per-row FP8 modules applied in the live tree
    per_tensor_from_row, report = apply_fp8(per_row, Fp8Config("per_tensor"))
    assert not report.already_applied and len(report.quantized) == 20
    # Quantized from the bf16 originals (not from FP8): bit-identical to quantizing the plain model.
    assert torch.equal(forward(per_tensor_from_row, inputs), expected)


def test_report_counts_and_bytes(cpu_fp8, tiny_flux):
    _, r = apply_fp8(tiny_flux, Fp8Config("per_row", "blocks"))
    dm = tiny_flux.model.diffusion_model
    bf16_bytes = sum(dm.get_submodule(n).weight.numel() * 2 for n in r.quantized)
    assert r.bytes_before == bf16_bytes
    # FP8 data is half the bytes of bf16; per-row adds one float32 scale per output row
    rows = sum(dm.get_submodule(n).weight.shape[0] for n in r.quantized)
    assert r.bytes_after == bf16_bytes // 2 + 4 * rows
    text = r.summary()
    assert "quantized 20 of 36 Linear layers" in text and f"{r.bytes_saved} bytes" in text
    assert "outside scope 'blocks'" in text and "img_in" in text


def test_remove_fp8_restores_the_original_computation(cpu_fp8, tiny_flux):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    ref = forward(tiny_flux, inputs)
    q, _ = apply_fp8(tiny_flux, Fp8Config())
    forward(q, inputs)
    base = remove_fp8(q)
    assert fp8_state(base) is None and FP8_KEY not in base.attachments and fp8_state(q).report.quantized
    assert torch.equal(forward(base, inputs), ref)


def test_steady_state_holds_only_fp8_copies(cpu_fp8, tiny_flux):
    """While the FP8 clone is loaded, the live module tree holds the FP8 Linears, not FP8 + bf16: the bf16
    originals sit only in ComfyUI's object-patch backup, on the offload device."""
    import comfy.model_management as mm

    bf16_bytes = sum(p.numel() * p.element_size() for p in tiny_flux.model.diffusion_model.parameters())
    q, r = apply_fp8(tiny_flux, Fp8Config())
    mm.load_models_gpu([q])
    dm = q.model.diffusion_model
    for name in r.quantized:
        lin = dm.get_submodule(name)
        assert is_fp8_linear(lin) and lin.weight.dtype == torch.float8_e4m3fn
        backup = swaps.original(q, f"diffusion_model.{name}")
        assert backup.weight.dtype == torch.bfloat16 and backup.weight.device == q.offload_device
    live_bytes = sum(p.numel() * p.element_size() for p in dm.parameters())
    live_bytes += sum(b.numel() * b.element_size() for n, b in dm.named_buffers() if n.endswith("fp8_weight_scale"))
    assert live_bytes == bf16_bytes - r.bytes_saved


def test_refuses_non_flux_model(cpu_fp8):
    import comfy.model_patcher
    import comfy.supported_models

    conf = comfy.supported_models.SD15({"image_size": 32, "use_spatial_transformer": True, "model_channels": 32, "in_channels": 4, "out_channels": 4,
                                        "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [1, 1],
                                        "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1, "context_dim": 64,
                                        "use_linear_in_transformer": False, "adm_in_channels": None,
                                        "use_temporal_attention": False, "use_temporal_resblock": False})
    conf.set_inference_dtype(torch.float32, None)
    sd15 = comfy.model_patcher.ModelPatcher(conf.get_model({}, device="meta"), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(FluxAccelError, match=r"accelerates FLUX\.1 .* received a BaseModel model .*UNetModel"):
        apply_fp8(sd15, Fp8Config())


def test_refuses_fp8_stored_weights(cpu_fp8, tiny_flux):
    dm = tiny_flux.model.diffusion_model
    with torch.no_grad():
        dm.double_blocks[0].img_attn.qkv.weight.data = dm.double_blocks[0].img_attn.qkv.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(FluxAccelError, match="already stored in reduced precision .*float8_e4m3fn.*weight_dtype 'default'"):
        apply_fp8(tiny_flux, Fp8Config())


def test_refuses_partially_loaded_model(cpu_fp8, tiny_flux):
    """ComfyUI's lowvram path (a real ModelPatcher.load with a VRAM budget below the model size)."""
    q, _ = apply_fp8(tiny_flux, Fp8Config())
    with pytest.raises(FluxAccelError, match="only partially.*--highvram"):
        q.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1024)
    q.unpatch_model(torch.device("cpu"))
    # a model that is already partially loaded is refused when the node runs, too
    tiny_flux.model.model_lowvram = True
    with pytest.raises(FluxAccelError, match="only partially"):
        apply_fp8(tiny_flux, Fp8Config())
    tiny_flux.model.model_lowvram = False


# --- weight patches (LoRA and the like) ---------------------------------------------------------------------
LORA_KEYS = ["diffusion_model.double_blocks.0.img_attn.qkv.weight", "diffusion_model.double_blocks.1.img_mlp.0.weight",
             "diffusion_model.single_blocks.0.linear1.weight", "diffusion_model.single_blocks.1.linear2.weight"]


def _lora_patches(model, seed=3) -> dict:
    """ComfyUI 'diff' weight patches on four quantized Linears, scaled by the weights in the live tree now."""
    sd = model.model.state_dict()  # keys as ComfyUI patches them: "diffusion_model.<...>.weight"
    g = torch.Generator().manual_seed(seed)
    std = {k: (sd[k].dequantize() if is_fp8_weight(sd[k]) else sd[k]).float().std() for k in LORA_KEYS}
    return {k: (torch.randn(sd[k].shape, generator=g) * std[k] * 2,) for k in LORA_KEYS}


def _with_lora(model, strength=1.0, seed=3, patches=None):
    """A clone with these weight patches (else _lora_patches'): what LoraLoaderModelOnly adds, as ComfyUI applies it
    at load time (comfy.lora.calculate_weight)."""
    clone = model.clone()
    clone.add_patches(patches or _lora_patches(model, seed), strength_patch=strength)
    return clone


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_before_quantize_is_merged_into_fp8(cpu_fp8, tiny_flux, compiled):
    from fluxaccel.core.quant.linear import quantize_linear

    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    base = forward(tiny_flux, inputs)
    lora = _with_lora(tiny_flux)
    lora_ref = forward(lora, inputs)
    assert rel_err(lora_ref, base) > 0.2, "the test LoRA must change the output clearly"
    # the weight ComfyUI's own load patched into the live tree (its compute dtype, its rounding), quantized here
    name = LORA_KEYS[0][len("diffusion_model."):-len(".weight")]
    expected = quantize_linear(lora.model.diffusion_model.get_submodule(name), Fp8Config("per_row"), "cpu")
    q, report = apply_fp8(lora, Fp8Config("per_row"))
    mine = swaps.get(q, f"diffusion_model.{name}")
    assert torch.equal(mine.weight.view(torch.uint8), expected.weight.view(torch.uint8))
    assert torch.equal(mine.fp8_weight_scale, expected.fp8_weight_scale)
    assert sorted(report.merged_patches) == sorted(LORA_KEYS) and "merged 4 weight patches" in report.summary()
    # the patches stay the clone's, as any clone's; the FP8 Linears hold them already, so ComfyUI's load merges nothing
    assert all(k in q.patches for k in LORA_KEYS)
    merges = owner_of(q).merges
    out = forward(q, inputs, compiled=compiled)
    assert owner_of(q).merges == merges
    assert rel_err(out, lora_ref) < BOUND, f"vs LoRA'd eager: {rel_err(out, lora_ref):.4f}"
    # the Benchmark's baseline (FP8 removed) runs the LoRA'd bf16 model again, bit for bit
    assert torch.equal(forward(remove_fp8(q), inputs), lora_ref)
    # another strength is another result, and FP8 follows it
    half = _with_lora(tiny_flux, strength=0.5)
    half_ref = forward(half, inputs)
    q_half, _ = apply_fp8(half, Fp8Config("per_row"))
    out_half = forward(q_half, inputs, compiled=compiled)
    assert rel_err(out_half, half_ref) < BOUND < rel_err(out_half, lora_ref)


def test_lora_after_quantize_is_merged_like_a_lora_before_it(cpu_fp8, tiny_flux):
    """A LoRA added after Quantize FP8 (weight patches on its FP8 Linears) is merged into them in place when ComfyUI
    loads the clone (its patch_weight_to_device, for a sampler or any other load): the same image as the LoRA placed
    before Quantize FP8, in the same objects and buffers as the plain FP8 clone's; the plain FP8 clone then runs its
    own weights again, and patches on bf16 layers stay ComfyUI's."""
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    lora, lora9 = _lora_patches(tiny_flux), _lora_patches(tiny_flux, seed=9)
    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    ref, plain = forward(q, inputs), sample(q, steps=2)
    name = LORA_KEYS[0][len("diffusion_model."):-len(".weight")]
    lin = swaps.get(q, f"diffusion_model.{name}")
    ptr = lin.weight.data_ptr()
    late = _with_lora(q, patches=lora)
    out_late = sample(late, steps=2)
    assert all(k in late.patches for k in LORA_KEYS)  # never taken off the clone
    assert swaps.get(late, f"diffusion_model.{name}") is lin and lin.weight.data_ptr() == ptr
    before = sample(apply_fp8(_with_lora(tiny_flux, patches=lora), Fp8Config("per_row"))[0], steps=2)
    assert torch.equal(out_late, before) and rel_err(out_late, plain) > 0.05
    assert torch.equal(sample(q, steps=2), plain) and torch.equal(forward(q, inputs), ref)  # its own weights again
    other = _with_lora(q, patches=lora9)  # a direct load, outside a sampler: merged the same way
    assert torch.equal(forward(other, inputs),
                       forward(apply_fp8(_with_lora(tiny_flux, patches=lora9), Fp8Config("per_row"))[0], inputs))
    mod_key = "diffusion_model.double_blocks.0.img_mod.lin.weight"
    w = tiny_flux.model.state_dict()[mod_key]
    ok = q.clone()
    ok.add_patches({mod_key: (torch.ones_like(w, dtype=torch.float32) * 1e-3,)})
    sample(ok, steps=1)
    assert rel_err(forward(ok, inputs), ref) > 0
    # without FP8 again (the Benchmark baseline), weight patches are ComfyUI's as usual
    sample(_with_lora(remove_fp8(q)), steps=1)


def test_a_lora_strength_change_merges_in_place_into_the_same_fp8_linears(cpu_fp8, tiny_flux):
    """LoRA strength 1.0 -> 0.5 -> 1.0 before Quantize FP8: each clone's FP8 Linears are the same objects and buffers,
    its weights are bit for bit what quantizing that clone afresh gives, and only patched Linears are merged again."""
    from fluxaccel.core.quant import store

    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    full, half = _with_lora(tiny_flux, strength=1.0), _with_lora(tiny_flux, strength=0.5)
    q_full, _ = apply_fp8(full, Fp8Config("per_row"))
    name = LORA_KEYS[0][len("diffusion_model."):-len(".weight")]
    lin = swaps.get(q_full, f"diffusion_model.{name}")
    ptrs = (lin.weight.data_ptr(), lin.fp8_weight_scale.data_ptr())
    out_full = forward(q_full, inputs)
    shared = owner_of(q_full)
    q_half, report = apply_fp8(half, Fp8Config("per_row"))
    assert owner_of(q_half) is shared and "merged in place when ComfyUI loads it" in report.weights_cache
    merges = shared.merges
    out_half = forward(q_half, inputs)
    assert shared.merges == merges + len(LORA_KEYS)  # the four patched Linears, nothing else
    assert swaps.get(q_half, f"diffusion_model.{name}") is lin
    assert (lin.weight.data_ptr(), lin.fp8_weight_scale.data_ptr()) == ptrs
    tiny_flux.model.__dict__.pop(store.SETS)  # the same clone quantized afresh: the reference
    fresh = apply_fp8(half, Fp8Config("per_row"))[0]
    assert torch.equal(forward(fresh, inputs), out_half)
    assert torch.equal(forward(q_full, inputs), out_full)  # back to 1.0 on the first store: its own weights again


def test_quantizes_unpatched_weights_while_another_clone_is_loaded(cpu_fp8, tiny_flux):
    """A LoRA'd clone loaded right now has its weights patched into the shared live modules; quantizing the
    plain model must read ComfyUI's backup of the originals, not the LoRA'd live weights."""
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    q_clean, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    clean = forward(q_clean, inputs)
    forward(_with_lora(tiny_flux), inputs)  # LoRA'd weights now live in the module tree
    q_during, report = apply_fp8(tiny_flux, Fp8Config("per_row"))
    assert report.merged_patches == []
    assert torch.equal(forward(q_during, inputs), clean)


def test_merges_a_lora_from_the_stored_weights_while_another_lora_is_loaded(cpu_fp8, tiny_flux):
    """Where another clone's LoRA is applied to the live tree now, the merge starts from ComfyUI's backup of the
    stored weights (equal to merging with nothing loaded), and nothing is unloaded for it."""
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    lora = _with_lora(tiny_flux)  # (its patches are scaled by the stored weights: made before another is loaded)
    expected = forward(apply_fp8(lora, Fp8Config("per_row"))[0], inputs)
    forward(_with_lora(tiny_flux, seed=5), inputs)  # another LoRA's weights now live in the module tree
    assert tiny_flux.backup
    q, report = apply_fp8(lora, Fp8Config("per_row"))
    assert len(report.merged_patches) == 4 and tiny_flux.backup
    assert torch.equal(forward(q, inputs), expected)


@pytest.mark.parametrize("share", [0.25, 4.0])
def test_fp8_copies_wait_on_the_load_device_only_with_room_beside_comfyuis_reserve(share):
    """The FP8 copies stay on the load device when ComfyUI's free-memory figure for it, minus ComfyUI's inference
    reserve, holds them (no host copy), else wait on the offload device; the report says which. A real ModelPatcher
    whose load device is this machine's CPU (ComfyUI reads its free memory from the machine) and whose offload
    device is another; the copies' size is chosen from those figures: a quarter of the room, or four times it."""
    import comfy.model_management as mm
    import comfy.model_patcher
    from fluxaccel.core.quant.build import fp8_home
    from fluxaccel.core.quant.report import Fp8Report

    cpu, elsewhere = torch.device("cpu"), torch.device("meta")
    patcher = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), load_device=cpu, offload_device=elsewhere)
    room = mm.get_free_memory(cpu) - mm.minimum_inference_memory()
    assert room > 0, room
    report = Fp8Report("per_row", "blocks", "cpu")
    home = fp8_home(patcher, patcher.load_device, int(room * share), report)
    assert home == (cpu if share < 1 else elsewhere)
    assert ("on cpu until ComfyUI loads" if share < 1 else "in host RAM") in report.summary()
