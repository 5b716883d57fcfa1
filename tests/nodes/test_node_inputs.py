"""nodes/: the schemas show only what changes a user's result, with the config dataclass's defaults and short
tooltips that carry no measurements; a compiled model's degradations reach the badge's state and the node's text."""
import re

import pytest

from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.inputs import node_defaults
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.nodes.benchmark import Benchmark
from fluxaccel.nodes.compile import Compile
from fluxaccel.nodes.quantize import QuantizeFP8
from fluxaccel.nodes.warmup import Warmup

SOCKETS = ("MODEL", "CONDITIONING")


def _widgets(node) -> dict:
    """{name: input} of a node's widget inputs (the sockets are not widgets)."""
    return {i.id: i for i in node.define_schema().inputs if i.get_io_type() not in SOCKETS}


@pytest.mark.parametrize("node, config, most", [(Compile, CompileConfig, 5), (QuantizeFP8, Fp8Config, 3)])
def test_widgets_are_the_config_fields_shown_with_its_defaults(node, config, most):
    widgets = _widgets(node)
    assert len(widgets) <= most and list(widgets) == list(node_defaults(config))
    for name, (default, advanced) in node_defaults(config).items():
        assert widgets[name].default == default and bool(widgets[name].advanced) == advanced, name
    assert node.define_schema().accept_all_inputs  # a saved workflow's removed inputs reach the node, which says them


@pytest.mark.parametrize("node", [Compile, QuantizeFP8, Warmup, Benchmark])
def test_tooltips_are_short_and_carry_no_measurements(node):
    schema = node.define_schema()
    texts = [i.tooltip for i in schema.inputs] + [o.tooltip for o in schema.outputs]
    for text in filter(None, texts):
        assert len(text) <= 200, text
        assert not re.search(r"H[12]00|\d+(\.\d+)? ?(ms|s)\b|\d+(\.\d+)? ?%|\bvs\b", text), text


def test_degradations_reach_the_badge_and_the_text(tiny_flux, cpu_fp8):
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.patches import describe
    from fluxaccel.core.quant.patch import apply_fp8
    from fluxaccel.nodes.events import compiled_state

    fp8, _ = apply_fp8(tiny_flux, Fp8Config(scope="blocks+modulation"))
    model, compiled = apply_compile(fp8, CompileConfig(separate_process=False))
    (d,) = compiled.stats.degradations
    assert d.what == "modulation table" and d.kind == "off" and "scope 'blocks' keeps them" in d.why
    state = compiled_state(compiled)
    assert state["degraded"] >= 1 and state["degradations"][0] == d.line() and d.line() in state["text"]
    assert describe(model)["degradations"][0] == d.line()
