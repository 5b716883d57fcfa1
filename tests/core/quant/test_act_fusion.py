"""core/quant/act_fusion.py: FLUX's MLP activations (FLUX.1's GELU, FLUX.2's SiLU gate) moved into the next FP8
Linear's quantization, on real ComfyUI FLUX models through Quantize FP8's apply_fp8."""
import pytest
import torch

from fluxaccel.core.quant import act_fusion
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8, fp8_state, remove_fp8
from fluxaccel.core.models import swaps
from support.runs import denoise_once, flux_inputs, forward


def _gelus(model) -> list[str]:
    return [n for n, m in model.model.diffusion_model.named_modules() if isinstance(m, torch.nn.GELU)]


def test_the_sites_of_comfyuis_flux_are_every_mlp(tiny_flux):
    """Both MLPs of each double block (GELU between two Linears) and each single block's mlp_act, whose output
    follows the attention output (hidden width) in linear2's input."""
    dm = tiny_flux.model.diffusion_model
    sites, kept = act_fusion.find_sites(dm)
    assert kept == {}
    hidden = dm.hidden_size
    assert {(s.module, s.linear, s.act_from, s.act) for s in sites} == {
        *((f"double_blocks.{i}.{s}_mlp.1", f"double_blocks.{i}.{s}_mlp.2", 0, "gelu") for i in (0, 1)
          for s in ("img", "txt")),
        *((f"single_blocks.{i}.mlp_act", f"single_blocks.{i}.linear2", hidden, "gelu") for i in (0, 1))}
    assert sorted(s.module for s in sites) == sorted(_gelus(tiny_flux))


def test_a_single_block_written_otherwise_keeps_its_gelu(tiny_flux):
    dm = tiny_flux.model.diffusion_model
    block_cls = type(dm.single_blocks[0])

    class Rewritten(block_cls):
        def forward(self, x, *args, **kwargs):  # GELU applied elsewhere than right before linear2's concatenation
            return super().forward(x, *args, **kwargs)

    dm.single_blocks[0].__class__ = Rewritten
    try:
        sites, kept = act_fusion.find_sites(dm)
    finally:
        dm.single_blocks[0].__class__ = block_cls
    assert "single_blocks.0.linear2" not in {s.linear for s in sites} and len(sites) == 5
    assert kept == {"single_blocks.0.mlp_act": ("gelu", "its block's forward is not the single block FluxAccel reads")}


def _unfused(model, monkeypatch, op: str):
    """apply_fp8 of `model` where the fused operator `op` (GELU_OP_UNAVAILABLE, SILU_GATE_OP_UNAVAILABLE) is not
    available: the unfused reference."""
    from fluxaccel.core.quant import fp8

    with monkeypatch.context() as m:
        m.setattr(fp8, op, "the unfused reference of this test")
        return apply_fp8(model, Fp8Config("per_row"))


def test_fused_computes_what_unfused_does_and_remove_fp8_restores_the_gelus(cpu_fp8, tiny_flux, monkeypatch):
    """The fused clone's forward equals the unfused one's bit for bit (the same GELU and quantization, in one op); the
    GELUs are Identity only in the fused clone's tree; remove_fp8 gives them back."""
    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    fused, report = apply_fp8(tiny_flux, Fp8Config("per_row"))
    plain, plain_report = _unfused(tiny_flux, monkeypatch, "GELU_OP_UNAVAILABLE")
    assert "fused into the FP8 quantization of the next Linear (one pass) at 6 of 6 GELUs" in report.summary()
    assert "MLP GELU kept separate: the unfused reference of this test" in plain_report.summary()
    assert len(fp8_state(fused).fused_keys) == 6 and fp8_state(plain).fused_keys == ()
    assert "SiLU" not in report.summary()  # FLUX.1 has no SiLU gate: its report has no line for one
    out = forward(fused, inputs)
    linear2 = fused.model.diffusion_model.single_blocks[0].linear2
    assert _gelus(fused) == [] and (linear2.fused_act, linear2.act_from) == \
        ("gelu", tiny_flux.model.diffusion_model.hidden_size)
    assert torch.equal(out, forward(plain, inputs))
    assert len(_gelus(plain)) == 6
    back = remove_fp8(fused)
    forward(back, inputs)
    assert len(_gelus(back)) == 6 and not any(swaps.get(back, k) for k in fp8_state(fused).fused_keys)


def test_per_tensor_scales_cannot_fuse_and_say_why(cpu_fp8, tiny_flux):
    cfg = Fp8Config("per_tensor")
    clone, report = apply_fp8(tiny_flux, cfg)
    assert "MLP GELU kept separate: per_tensor activation scales need the whole" in report.summary()
    assert fp8_state(clone).fused_keys == () and cfg.key() == cfg.weights_key()


def test_without_the_operator_fusion_is_off_and_said(cpu_fp8, tiny_flux, monkeypatch):
    """A torch that could not register the fused operator: Quantize FP8 keeps the GELUs and says why."""
    from fluxaccel.core.quant import fp8

    monkeypatch.setattr(fp8, "GELU_OP_UNAVAILABLE", "torch 9.9 could not register the fluxaccel::gelu_rowwise_fp8 "
                                                    "operator (RuntimeError: test)")
    clone, report = apply_fp8(tiny_flux, Fp8Config("per_row"))
    assert "MLP GELU kept separate: torch 9.9 could not register" in report.summary()
    assert fp8_state(clone).fused_keys == () and len(_gelus(clone)) == 6


def test_a_double_block_that_does_not_call_its_mlp_whole_keeps_its_gelus(tiny_flux):
    """A forward that indexes its MLP (and could apply GELU itself) is not one whose GELU module can move."""
    dm = tiny_flux.model.diffusion_model
    block_cls = type(dm.double_blocks[1])

    class Indexing(block_cls):
        def forward(self, img, *args, **kwargs):  # reads self.img_mlp[0] etc.
            return super().forward(img, *args, **kwargs)

    dm.double_blocks[1].__class__ = Indexing
    try:
        assert not act_fusion.mlp_called_whole(dm.double_blocks[1], "img_mlp")
        sites, kept = act_fusion.find_sites(dm)
    finally:
        dm.double_blocks[1].__class__ = block_cls
    assert {s.module for s in sites}.isdisjoint({"double_blocks.1.img_mlp.1", "double_blocks.1.txt_mlp.1"})
    assert kept == {f"double_blocks.1.{s}_mlp.1": ("gelu", "its block's forward does not call the MLP as one module")
                    for s in ("img", "txt")}


def test_rows_wider_than_the_kernel_holds_keep_their_gelu(tiny_flux, monkeypatch):
    monkeypatch.setattr(act_fusion, "MAX_ROW", tiny_flux.model.diffusion_model.hidden_size * 4 - 1)
    sites, kept = act_fusion.find_sites(tiny_flux.model.diffusion_model)
    # the double blocks' fc2 rows (4x hidden) are now too wide, the single blocks' (5x hidden) too
    assert sites == [] and len(kept) == 6 and all("wider than" in why for _, why in kept.values())


# FLUX.2: ComfyUI's SiLU-gated MLPs (SiLUActivation: SiLU(m1) * m2 of the first Linear's whole output)

@pytest.fixture
def tiny_flux2():
    from support.models import build_flux
    from support.shapes import TINY_FLUX2

    return build_flux(TINY_FLUX2, seed=0)


def _silu_gates(model) -> list[str]:
    return [n for n, m in model.model.diffusion_model.named_modules() if type(m).__name__ == "SiLUActivation"]


def test_the_sites_of_flux2_are_its_silu_gates(tiny_flux2):
    """Every double block's two MLPs and every single block's mlp_act are SiLU gates: sites of kind silu_gate, with
    linear2's gated part after the attention output (hidden width)."""
    dm = tiny_flux2.model.diffusion_model
    sites, kept = act_fusion.find_sites(dm)
    hidden = dm.hidden_size
    assert kept == {} and {s.act for s in sites} == {"silu_gate"}
    assert sorted(s.module for s in sites) == sorted(_silu_gates(tiny_flux2)) and len(sites) > 0
    singles = [s for s in sites if s.module.endswith("mlp_act")]
    assert singles and all(s.act_from == hidden for s in singles)
    assert all(s.act_from == 0 for s in sites if s not in singles)


def test_a_silu_gate_written_otherwise_is_not_a_site(tiny_flux2):
    """A SiLUActivation whose forward is not ComfyUI's gate (here: the halves swapped) keeps its module."""
    dm = tiny_flux2.model.diffusion_model
    gate = dm.double_blocks[0].img_mlp[1]
    cls = type(gate)

    class Swapped(cls):
        def forward(self, x):
            x2, x1 = x.chunk(2, dim=-1)
            return self.gate_fn(x1) * x2

    gate.__class__ = Swapped
    try:
        sites, kept = act_fusion.find_sites(dm)
    finally:
        gate.__class__ = cls
    assert "double_blocks.0.img_mlp.1" not in {s.module for s in sites}
    assert kept == {"double_blocks.0.img_mlp.1": ("silu_gate", "its forward is not the SiLU gate FluxAccel reads")}


def test_flux2_fused_computes_what_unfused_does(cpu_fp8, tiny_flux2, monkeypatch):
    """FLUX.2 with its SiLU gates fused: the forward equals the unfused one's bit for bit, the report names the
    SiLU-gate line (and FLUX.2's lack of GELU), without the operator they are kept and said, remove_fp8 restores
    them."""
    n = len(_silu_gates(tiny_flux2))
    fused, report = apply_fp8(tiny_flux2, Fp8Config("per_row"))
    plain, plain_report = _unfused(tiny_flux2, monkeypatch, "SILU_GATE_OP_UNAVAILABLE")
    assert f"MLP SiLU gate fused into the FP8 quantization of the next Linear (one pass) at {n} of {n} SiLU gates" \
        in report.summary() and "no GELU(tanh) MLP in this model to fuse" in report.summary()
    assert "MLP SiLU gate kept separate: the unfused reference of this test" in plain_report.summary()
    assert len(fp8_state(fused).fused_keys) == n and fp8_state(plain).fused_keys == ()
    assert "silu-gate-fused" in fp8_state(fused).config.key()
    out = denoise_once(fused, hw=8)
    assert _silu_gates(fused) == []
    linear2 = fused.model.diffusion_model.single_blocks[0].linear2
    assert (linear2.fused_act, linear2.act_from) == ("silu_gate", tiny_flux2.model.diffusion_model.hidden_size)
    assert torch.equal(out, denoise_once(plain, hw=8))
    assert len(_silu_gates(plain)) == n
    back = remove_fp8(fused)
    assert torch.equal(denoise_once(back, hw=8), denoise_once(tiny_flux2, hw=8))
    assert len(_silu_gates(back)) == n
