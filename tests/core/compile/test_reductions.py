"""core/compile/reductions.py and torch_internals.persistent_reductions: which reductions inductor makes persistent
inside FluxAccel's compile, decided by inductor's own choices handler and sizes (real inductor objects; the CPU
backend generates no Triton, so the kernels themselves run only in the GPU runs, bench/device.sh)."""
from types import SimpleNamespace

import pytest
import sympy
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V

from fluxaccel.core.compile import reductions


def features(elements: int, hint: ReductionHint):
    """What inductor's choices handler reads of a kernel's reduction (SIMDKernelFeatures' answers for it)."""
    return SimpleNamespace(reduction_numel=sympy.Integer(elements), numel=sympy.Integer(4096),
                           get_reduction_hint=lambda: hint, strict_sum_rblock=lambda: None,
                           has_strict_sum_multirow_reduction=lambda: False)


@pytest.fixture
def graph():
    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
        yield


def decide(elements, hint, cooperative=False) -> bool:
    return bool(V.choices.should_use_persistent_reduction(features(elements, hint), cooperative))


@pytest.mark.parametrize("elements, hint, inside", [
    (3072, ReductionHint.INNER, True),  # FLUX.1's LayerNorm rows: looped by inductor's own rule, persistent here
    (6144, ReductionHint.INNER, True),  # FLUX.2 [dev]'s LayerNorm rows
    (reductions.ROWS, ReductionHint.INNER, True),
    (reductions.ROWS + 1, ReductionHint.INNER, False),
    (12288, ReductionHint.INNER, False),  # the unfused GELU's rows (slower persistent on the H200)
    (128, ReductionHint.DEFAULT, True),
    (reductions.OTHER + 1, ReductionHint.DEFAULT, False),
    (3072, ReductionHint.OUTER, False),  # column reductions stay inductor's
])
def test_which_reductions_become_persistent(graph, elements, hint, inside):
    assert decide(elements, hint) is False  # inductor's own rule loops over each of these
    with reductions.persistent():
        assert decide(elements, hint) is inside
        assert decide(elements, hint, cooperative=True) is False  # cooperative reductions: inductor's decision
    assert decide(elements, hint) is False


def test_inductors_own_persistent_decisions_and_setting_stand(graph):
    with reductions.persistent():
        assert decide(512, ReductionHint.INNER) is True
        with torch._inductor.config.patch({"triton.persistent_reductions": False}):
            assert decide(3072, ReductionHint.INNER) is False
            assert decide(512, ReductionHint.INNER) is False


def test_only_the_body_sees_it_and_a_users_cache_tag_is_kept():
    before = type(V.choices)
    with torch.compiler.config.patch(cache_key_tag="users-tag"):
        with reductions.persistent():
            assert type(V.choices) is not before and isinstance(V.choices, before)
            assert torch.compiler.config.cache_key_tag == f"users-tag|{V.choices.uuid()}"
        assert type(V.choices) is before and torch.compiler.config.cache_key_tag == "users-tag"


def test_a_graph_compiled_inside_does_not_share_inductors_cache_with_one_compiled_outside(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def norm(x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * 2

    x = torch.randn(8, 3072)

    def compile_once():
        torch._dynamo.reset()
        misses = counters["inductor"]["fxgraph_cache_miss"]
        out = torch.compile(norm, options={"fx_graph_cache": True})(x)
        return out, counters["inductor"]["fxgraph_cache_miss"] - misses

    outside, miss = compile_once()
    assert miss == 1
    assert compile_once()[1] == 0  # the same graph again: inductor's cache hands it out
    with reductions.persistent():
        inside, miss = compile_once()
    assert miss == 1  # lowered with FluxAccel's choice: not the entry lowered without it
    torch.testing.assert_close(inside, outside)
