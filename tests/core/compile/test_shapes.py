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


def test_recompile_allows_up_to_max_shapes_then_runs_more_uncompiled_said_once(caplog):
    p = ShapePolicy("recompile", 2)
    assert p.decide(B, [A]) == "new"
    with caplog.at_level("WARNING", logger="fluxaccel.compile"):
        assert p.decide(C, [A, B]) == "eager" and p.decide(C, [A, B]) == "eager"
    said = [r.getMessage() for r in caplog.records if "max_shapes" in r.getMessage()]
    assert len(said) == 1 and "holds its 2 shapes already" in said[0] and "Raise max_shapes" in said[0], said


def test_the_default_policy_never_refuses_a_shape():
    from fluxaccel.core.compile.config import CompileConfig

    cfg = CompileConfig()
    p = ShapePolicy(cfg.resolution_policy, cfg.max_shapes)
    allowed = [A]
    for key in (B, C, ShapeKey(1, 64, 64, 512, "bfloat16"), ShapeKey(1, 80, 64, 512, "bfloat16"),
                ShapeKey(1, 64, 80, 512, "bfloat16")):
        decision = p.decide(key, allowed)
        assert decision in ("new", "eager")
        if decision == "new":
            allowed.append(key)
    assert len(allowed) == cfg.max_shapes


def test_eager_fallback_runs_other_shapes_uncompiled(caplog):
    with caplog.at_level("WARNING", logger="fluxaccel.compile"):
        assert ShapePolicy("eager_fallback", 4).decide(B, [A]) == "eager"
    assert "its calls run uncompiled, counted (resolution_policy eager_fallback)" in caplog.text


def test_register_is_bounded_by_max_shapes_whatever_the_policy():
    p = ShapePolicy("strict", 2)
    assert p.register(B, [A]) is True and p.register(A, [A]) is False
    with pytest.raises(FluxAccelError, match=r"more shapes than the Compile node's max_shapes \(2\)"):
        p.register(C, [A, B])
