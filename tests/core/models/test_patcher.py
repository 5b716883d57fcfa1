"""core/models/patcher.py and generations.py against ComfyUI 0.33's real ModelPatcher, load_models_gpu, LoRA loading
and hook LoRAs: which weights ComfyUI writes, how a switch between clones is made, what is counted as written."""
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.models.generations import of_model
from fluxaccel.core.models.patcher import own_clone, stamp
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.models import build_flux, lora_state_dict, synthetic_conditioning_for, with_lora

QKV = "diffusion_model.double_blocks.0.img_attn.qkv.weight"  # an FP8 Linear under the default scope
MOD = "diffusion_model.double_blocks.0.img_mod.lin.weight"  # a modulation: bf16 under the default scope
TARGETS = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_mod.lin", "single_blocks.0.linear1"]


def _load(model):
    import comfy.model_management as mm

    mm.load_models_gpu([model])


def test_a_switch_between_clones_of_a_loaded_model_restores_in_place_and_counts_the_writes(monkeypatch):
    """LoRA strength 1.0, then 0.5 (two of FluxAccel's clones of one loaded model): ComfyUI's own unpatch restores the
    first clone's patches where the weights are (no move to the offload device), its load patches the second's; each
    restore and each patch raises exactly that key's generation, and the weights equal a plain clone's."""
    import comfy.model_patcher as mp

    base = build_flux("tiny", dtype=torch.float32)
    sd = lora_state_dict(base, ["double_blocks.0.img_mod.lin", "single_blocks.0.linear2"])
    calls = []
    real = mp.ModelPatcher.unpatch_model
    monkeypatch.setattr(mp.ModelPatcher, "unpatch_model",
                        lambda self, device_to=None, unpatch_weights=True: calls.append((device_to, unpatch_weights))
                        or real(self, device_to, unpatch_weights))
    gens = of_model(base.model)
    keys = [f"diffusion_model.{t}.weight" for t in ("double_blocks.0.img_mod.lin", "single_blocks.0.linear2")]
    a = own_clone(with_lora(base, sd, 1.0))
    _load(a)
    assert [gens[k] for k in keys] == [1, 1] and gens[QKV] == 0
    b = own_clone(with_lora(base, sd, 0.5))
    calls.clear()
    _load(b)
    assert calls[0] == (None, True)  # restored in place
    assert not [c for c in calls if c[0] is not None and c[1]]  # no unpatch that moves the weights
    assert [gens[k] for k in keys] == [3, 3] and gens[QKV] == 0  # restored, patched again; nothing else
    expected = with_lora(base, sd, 0.5)
    _load(expected)
    assert all(torch.equal(expected.model.state_dict()[k], b.model.state_dict()[k]) for k in keys)


def test_writes_by_another_patcher_of_the_model_are_counted_before_fluxaccel_runs_again():
    """A plain clone (an eager branch of the same loaded model) loaded between two of FluxAccel's: what it restores
    of FluxAccel's patches and what it patches itself are counted as written when FluxAccel's next clone loads --
    including a key FluxAccel's earlier clone patched and the next one does not."""
    base = build_flux("tiny", dtype=torch.float32)
    a_sd = lora_state_dict(base, ["double_blocks.0.img_mod.lin"], seed=1)
    p_sd = lora_state_dict(base, ["single_blocks.0.linear2"], seed=2)
    gens = of_model(base.model)
    ours = own_clone(with_lora(base, a_sd, 1.0))
    _load(ours)
    seen = {k: stamp(ours, k) for k in (MOD, "diffusion_model.single_blocks.0.linear2.weight")}
    _load(with_lora(base, p_sd, 1.0))  # ComfyUI's plain patcher: restores MOD, patches linear2
    later = own_clone(base)  # FluxAccel's clone without any LoRA
    _load(later)
    assert all(stamp(later, k) != s for k, s in seen.items())  # both rewritten since FluxAccel last read them
    assert not gens.patched and torch.equal(later.model.state_dict()[MOD], base.model.state_dict()[MOD])


def test_a_clone_of_fluxaccels_clone_keeps_its_class_and_a_fresh_uuid_is_its_own():
    base = build_flux("tiny")
    ours = own_clone(base)
    assert type(ours) is not type(base) and isinstance(ours, type(base))
    assert ours.patches_uuid != base.patches_uuid
    lora = with_lora(ours, lora_state_dict(base, ["single_blocks.0.linear2"]), 1.0)  # a LoRA node after ours
    assert type(lora) is type(ours)


# -- ComfyUI's hook LoRAs ----------------------------------------------------------------------------------------------
def _hooked_sample(model, sd, keyframes=((1.0, 0.0),), steps=4, strength=1.0):
    """KSampler's sampling with a hook LoRA on the positive conditioning: Create Hook LoRA (its create_hook_lora),
    Create Hook Keyframe per (strength_mult, start_percent), Set Hook Keyframes, Cond Set Props (ComfyUI's nodes)."""
    import comfy.hooks
    import comfy.sample
    from comfy_extras import nodes_hooks

    hooks = comfy.hooks.create_hook_lora(lora=sd, strength_model=strength, strength_clip=0.0)
    kf = None
    for mult, start in keyframes:
        kf = nodes_hooks.CreateHookKeyframe().create_hook_keyframe(mult, start, kf)[0]
    hooks = nodes_hooks.SetHookKeyframes().set_hook_keyframes(hooks, kf)[0]
    dm = model.model.diffusion_model
    pos = nodes_hooks.ConditioningSetProperties().set_properties(synthetic_conditioning_for(dm, 16), 1.0, "default",
                                                                  hooks=hooks)[0]
    neg = synthetic_conditioning_for(dm, 16, seed=100)
    latent = torch.zeros(1, 16, 16, 16)
    return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 0), steps, 1.0, "euler", "simple", pos, neg,
                               latent, disable_pbar=True, seed=0)


def test_a_hook_lora_on_fp8_linears_equals_the_same_lora_merged_before_sampling(cpu_fp8):
    """A hook LoRA at a constant strength on FP8 Linears and a modulation is merged the way ComfyUI applies a hook on
    top of a patched weight: the image equals the same LoRA loaded by LoraLoaderModelOnly before Quantize FP8, bit for
    bit; the FP8 clone without the hook runs its own weights again afterwards."""
    from support.runs import sample

    base = build_flux("tiny")
    sd = lora_state_dict(base, TARGETS)
    fp8, _ = apply_fp8(base, Fp8Config())
    plain = sample(fp8, steps=4)
    hooked = _hooked_sample(fp8, sd)
    assert torch.equal(hooked, sample(apply_fp8(with_lora(base, sd, 1.0), Fp8Config())[0], steps=4))
    assert rel_err(hooked, plain) > 1e-2
    assert torch.equal(sample(fp8, steps=4), plain)


def test_hook_keyframes_on_fp8_and_modulation_weights_follow_eager_comfyui(cpu_fp8):
    """Keyframes (the hook at full strength, then off from half-way): FluxAccel's FP8 model follows eager ComfyUI
    with the same hook within FP8's error, and differs from the hook held at full strength."""
    base = build_flux("tiny")
    sd = lora_state_dict(base, TARGETS)
    keyframes = ((1.0, 0.0), (0.0, 0.5))
    eager = _hooked_sample(base, sd, keyframes)
    fp8 = _hooked_sample(apply_fp8(base, Fp8Config())[0], sd, keyframes)
    assert rel_err(fp8, eager) < 0.08
    assert rel_err(fp8, _hooked_sample(apply_fp8(base, Fp8Config())[0], sd)) > 1e-2


def test_hook_keyframes_on_a_compiled_model_equal_eager_comfyui():
    """Compile (float32, no FP8): hook weights ComfyUI writes in place during sampling, the modulation's too, reach
    the compiled blocks and the modulation table (rebuilt when its weights' generations move): equal to eager."""
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile

    base = build_flux("tiny", dtype=torch.float32)
    sd = lora_state_dict(base, TARGETS)
    keyframes = ((1.0, 0.0), (0.25, 0.5))
    compiled, c = apply_compile(base, CompileConfig(separate_process=False))
    out, eager = _hooked_sample(compiled, sd, keyframes), _hooked_sample(base, sd, keyframes)
    assert rel_err(out, eager) < 1e-4 and rel_err(eager, _hooked_sample(base, sd)) > 1e-3
    assert c.stats.eager_calls == 0


def test_a_hook_lora_on_a_dynamic_vram_model_is_refused_with_comfyuis_own_cause(cpu_fp8, tmp_path):
    """ComfyUI's dynamic VRAM does not apply hook weight patches (ModelPatcherDynamic refuses them); FluxAccel's
    resident copy of such a model says the same, with the way out, instead of a misleading error."""
    from support.models import dynamic_patcher, write_flux_file

    dyn = dynamic_patcher(write_flux_file(tmp_path / "m.safetensors", "e2e"))
    fp8, _ = apply_fp8(dyn, Fp8Config())
    with pytest.raises(FluxAccelError, match="dynamic VRAM: ComfyUI does not apply hook weight patches.*"
                                             "--disable-dynamic-vram"):
        _hooked_sample(fp8, lora_state_dict(dyn, TARGETS))
