"""core/compile/shapes.py: the shape policy decides without compiling anything."""
import pytest

from fluxaccel.core.compile.shapes import ShapeKey, ShapePolicy
from fluxaccel.core.errors import FluxAccelError

A, B, C = ShapeKey(1, 128, 128, 512, "bfloat16"), ShapeKey(1, 96, 128, 512, "bfloat16"), ShapeKey(2, 128, 128, 512, "bfloat16")


def test_first_shape_is_new_then_known_under_every_policy():
    for policy in ("strict", "recompile", "eager_fallback"):
        p = ShapePolicy(policy, 4)
        assert p.decide(A, []) == "new" and p.decide(A, [A]) == "known"


def test_strict_refuses_a_second_shape_naming_both():
    with pytest.raises(FluxAccelError, match=r"compiled for batch 1, latent 128x128 .* but received batch 1, latent 96x128"):
        ShapePolicy("strict", 4).decide(B, [A])


def test_recompile_allows_up_to_max_shapes_then_refuses():
    p = ShapePolicy("recompile", 2)
    assert p.decide(B, [A]) == "new"
    with pytest.raises(FluxAccelError, match=r"already holds 2 shapes \(max_shapes 2\).*Raise max_shapes"):
        p.decide(C, [A, B])


def test_eager_fallback_runs_other_shapes_uncompiled(caplog):
    with caplog.at_level("WARNING", logger="fluxaccel.compile"):
        assert ShapePolicy("eager_fallback", 4).decide(B, [A]) == "eager"
    assert "running this call uncompiled" in caplog.text


def test_register_is_bounded_by_max_shapes_whatever_the_policy():
    p = ShapePolicy("strict", 2)
    assert p.register(B, [A]) is True and p.register(A, [A]) is False
    with pytest.raises(FluxAccelError, match=r"more shapes than the Compile node's max_shapes \(2\)"):
        p.register(C, [A, B])
