"""nodes/: inputs a node does not have are refused by name (the Compile node accepts all inputs to see them), and a
compiled model's degradations reach the badge's state."""
import pytest

from fluxaccel.core.errors import FluxAccelError
from fluxaccel.nodes.validation import refuse_unknown_inputs


def test_clear_cache_on_in_an_old_workflow_is_refused_and_nothing_cleared(tmp_path, monkeypatch):
    from fluxaccel.core.compile import kernel_cache

    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path))
    kept = tmp_path / "x.bin"
    kept.write_bytes(kernel_cache.MAGIC + b"{}\n")
    with pytest.raises(FluxAccelError, match=r"clear_cache is no longer a setting of the Compile node.*Nothing was "
                                             r"cleared.*tools/clear_cache\.py"):
        refuse_unknown_inputs({"clear_cache": True})
    assert kept.is_file()


def test_clear_cache_off_is_what_happens_anyway():
    refuse_unknown_inputs({"clear_cache": False})
    refuse_unknown_inputs({})


def test_an_input_the_node_does_not_have_is_named():
    with pytest.raises(FluxAccelError, match=r"This node has no input 'max_shape' \(set to 3\)"):
        refuse_unknown_inputs({"max_shape": 3})


def test_the_compile_schema_accepts_all_inputs_where_comfyui_has_the_option_and_says_so_where_not(caplog):
    """ComfyUI 0.33's node schema has accept_all_inputs; 0.3.75's has not (its Schema without the field): the node
    then loads without it and the log says, once, that ComfyUI drops inputs the node no longer has."""
    import dataclasses
    import logging

    from comfy_api.latest import io
    from fluxaccel.nodes.compile import Compile
    from fluxaccel.nodes.validation import accept_all_inputs

    has_it = "accept_all_inputs" in {f.name for f in dataclasses.fields(io.Schema)}
    assert Compile.define_schema().accept_all_inputs if has_it else True
    assert accept_all_inputs(io.Schema, "Compile") == ({"accept_all_inputs": True} if has_it else {})

    @dataclasses.dataclass
    class OlderSchema:  # a node schema of a ComfyUI without the option
        node_id: str = ""

    with caplog.at_level(logging.WARNING, logger="fluxaccel.nodes"):
        assert accept_all_inputs(OlderSchema, "Test") == {} and accept_all_inputs(OlderSchema, "Test") == {}
    said = [r.getMessage() for r in caplog.records if "the Test node" in r.getMessage()]
    assert said == ["FluxAccel: this ComfyUI's node schema has no accept_all_inputs: inputs the Test node no longer "
                    "has (e.g. clear_cache in an old workflow) are dropped by ComfyUI without a message"]


def test_degradations_reach_the_badge_and_the_description(tiny_flux, cpu_fp8):
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.patches import describe
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from fluxaccel.nodes.events import compiled_state

    fp8, _ = apply_fp8(tiny_flux, Fp8Config(layout="subclass"))
    model, compiled = apply_compile(fp8, CompileConfig(separate_process=False))
    (d,) = compiled.stats.degradations
    assert d.what == "block_regions" and d.kind == "off" and "layout 'plain'" in d.why
    state = compiled_state(compiled)
    assert state["degraded"] >= 1 and state["degradations"][0] == d.line()
    assert describe(model)["degradations"][0] == d.line()
