"""core/models/swaps.py: FluxAccel's module swaps as one ComfyUI object patch per block, on real ModelPatchers and
ComfyUI's own load (load_models_gpu re-applies every object patch at every prompt)."""
import copy
import logging

import torch

from fluxaccel.core.compile import mod_table
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, remove_compile
from fluxaccel.core.models import swaps
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.linear import is_fp8_linear
from fluxaccel.core.quant.patch import apply_fp8, fp8_state, remove_fp8
from support.runs import flux_inputs, forward, repatches_per_prompt

TABLE = CompileConfig(separate_process=False)


def _block_keys(model) -> set[str]:
    dm = model.model.diffusion_model
    return {f"diffusion_model.{kind}.{i}" for kind in swaps.BLOCK_LISTS for i in range(len(getattr(dm, kind)))}


def test_quantize_and_compile_patch_each_block_once_and_comfyui_reapplies_only_those(cpu_fp8, tiny_flux,
                                                                                       monkeypatch):
    q, report = apply_fp8(tiny_flux, Fp8Config())
    c, _ = apply_compile(q, TABLE)
    assert set(q.object_patches) == set(c.object_patches) == _block_keys(tiny_flux)
    swapped = {f"diffusion_model.{n}" for n in report.quantized} | set(fp8_state(q).fused_keys)
    assert {k for k, _ in swaps.items(q)} == swapped and len(swapped) > len(q.object_patches)
    table = {k for k, v in swaps.items(c) if isinstance(v, mod_table.TableModulation)}
    assert {k for k, _ in swaps.items(c)} == swapped | table and len(table) == 2 * 2 + 2
    assert repatches_per_prompt(monkeypatch, c) == 2 * len(_block_keys(tiny_flux)), "undone and redone: one per block"
    assert repatches_per_prompt(monkeypatch, tiny_flux) == 0


def test_a_block_copy_shares_every_module_and_weight_it_does_not_swap(cpu_fp8, tiny_flux):
    q, _ = apply_fp8(tiny_flux, Fp8Config())
    c, _ = apply_compile(q, TABLE)
    orig = tiny_flux.model.diffusion_model.double_blocks[0]
    mine, theirs = q.object_patches["diffusion_model.double_blocks.0"], c.object_patches["diffusion_model.double_blocks.0"]
    assert len({id(orig), id(mine), id(theirs)}) == 3, "each clone its own copy; the model keeps its block"
    assert mine.img_attn is not orig.img_attn and mine.img_attn.norm is orig.img_attn.norm
    assert is_fp8_linear(mine.img_attn.qkv) and not is_fp8_linear(orig.img_attn.qkv)
    assert mine.img_mod is orig.img_mod and isinstance(theirs.img_mod, mod_table.TableModulation)
    assert theirs.img_attn.qkv is mine.img_attn.qkv, "the Compile clone's copy holds Quantize FP8's Linears"
    swapped = ("img_attn.qkv", "img_attn.proj", "img_mlp", "txt_attn.qkv", "txt_attn.proj", "txt_mlp", "img_mod",
               "txt_mod")
    kept = {n: p for n, p in orig.named_parameters() if not n.startswith(swapped)}
    assert kept and all(dict(theirs.named_parameters())[n] is p for n, p in kept.items())


def test_branches_run_their_own_modules_and_the_model_its_own_after_them(cpu_fp8, tiny_flux):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    ref = forward(tiny_flux, inputs)
    q, _ = apply_fp8(tiny_flux, Fp8Config())
    c, _ = apply_compile(q, TABLE)
    fp8_out = forward(q, inputs)
    forward(c, inputs)
    live = tiny_flux.model.diffusion_model.double_blocks[0]
    assert live is c.object_patches["diffusion_model.double_blocks.0"]
    # while the Compile clone is applied, the model without patches is read through ComfyUI's backup
    orig = swaps.original(q, "diffusion_model.double_blocks.0")
    assert orig is not live and not is_fp8_linear(swaps.original(q, "diffusion_model.double_blocks.0.img_attn.qkv"))
    assert type(swaps.original(q, "diffusion_model.double_blocks.0.img_mod")).__name__ == "Modulation"
    assert swaps.original(q, "diffusion_model.no_such_module", "default") == "default"
    assert torch.equal(forward(q, inputs), fp8_out)
    assert torch.equal(forward(tiny_flux, inputs), ref)
    assert tiny_flux.model.diffusion_model.double_blocks[0] is orig and not tiny_flux.object_patches_backup


def test_removing_takes_the_swaps_off_block_by_block(cpu_fp8, tiny_flux):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    q, _ = apply_fp8(tiny_flux, Fp8Config())
    c, _ = apply_compile(q, TABLE)
    uncompiled = remove_compile(c)
    assert not any(isinstance(v, mod_table.TableModulation) for _, v in swaps.items(uncompiled))
    assert {k for k, _ in swaps.items(uncompiled)} == {k for k, _ in swaps.items(q)}
    assert set(c.object_patches) == _block_keys(tiny_flux), "the input clone keeps its copies"
    assert torch.equal(forward(uncompiled, inputs), forward(q, inputs))
    assert remove_fp8(q).object_patches == {} and swaps.items(remove_fp8(q)) == []


def test_a_block_with_another_nodes_patch_keeps_one_patch_per_module_and_says_so(cpu_fp8, tiny_flux, caplog):
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    expected = forward(apply_fp8(tiny_flux, Fp8Config())[0], inputs)
    other = tiny_flux.clone()
    norm = copy.deepcopy(tiny_flux.model.diffusion_model.double_blocks[1].img_norm1)  # the same numbers
    other.add_object_patch("diffusion_model.double_blocks.1.img_norm1", norm)
    with caplog.at_level(logging.INFO, logger="fluxaccel.patches"):
        q, _ = apply_fp8(other, Fp8Config())
    assert "1 blocks hold another node's object patches (e.g. diffusion_model.double_blocks.1)" in caplog.text
    assert "diffusion_model.double_blocks.1" not in q.object_patches
    assert is_fp8_linear(q.object_patches["diffusion_model.double_blocks.1.img_attn.qkv"])
    assert q.object_patches["diffusion_model.double_blocks.1.img_norm1"] is norm
    assert "diffusion_model.double_blocks.0" in q.object_patches
    assert torch.equal(forward(q, inputs), expected)
    assert tiny_flux.model.diffusion_model.double_blocks[1].img_norm1 is norm, "the patch applied while q ran"
    c, _ = apply_compile(q, TABLE)
    assert isinstance(c.object_patches["diffusion_model.double_blocks.1.img_mod"], mod_table.TableModulation)
    assert swaps.get(c, "diffusion_model.double_blocks.1.img_norm1") is norm
    assert swaps.get(c, "diffusion_model.double_blocks.0.img_norm1") is None
