"""core/compile/options.py: every transformer_options key is passed into the graph, refused by name, or one ComfyUI's
FLUX provably never reads."""
import inspect
import logging

import pytest

from fluxaccel.core.compile import options
from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first
from fluxaccel.core.errors import FluxAccelError


def test_not_read_keys_are_not_read_by_comfyuis_flux():
    """The keys left out of the graph are ones ComfyUI's FLUX code (model, layers, math, attention) never names: if a
    newer ComfyUI reads one, this fails and the key must be passed."""
    import comfy.ldm.flux.layers
    import comfy.ldm.flux.math
    import comfy.ldm.flux.model
    import comfy.ldm.modules.attention

    source = "".join(inspect.getsource(m) for m in (comfy.ldm.flux.model, comfy.ldm.flux.layers, comfy.ldm.flux.math,
                                                      comfy.ldm.modules.attention))
    for key in options.NOT_READ:
        assert f'"{key}"' not in source and f"'{key}'" not in source, key


def test_known_and_unknown_keys_are_passed_bookkeeping_left_out(caplog):
    opts = {"rope_options": {"scale_x": 2.0}, "uuids": [object()], "sigmas": 1, "cond_or_uncond": [0],
            "patches": {}, "wrappers": {}, "some_future_key": 3}
    with caplog.at_level(logging.INFO, logger="fluxaccel.compile"):
        out = options.call_options(opts)
    assert out == {"rope_options": {"scale_x": 2.0}, "some_future_key": 3, OVERRIDE_KEY: sdpa_cudnn_first}
    assert "transformer_options['some_future_key'] is passed into the compiled graph" in caplog.text


def test_the_workflows_attention_override_is_kept():
    mine = lambda *a, **k: None  # noqa: E731
    assert options.call_options({OVERRIDE_KEY: mine})[OVERRIDE_KEY] is mine


@pytest.mark.parametrize("opts,named", [
    ({"patches": {"double_block": [print]}}, "patches.double_block"),
    ({"patches_replace": {"dit": {("double_block", 0): print}}}, "patches_replace.dit"),
    ({"wrappers": {"diffusion_model": {"mine": [print]}}}, "diffusion_model wrapper 'mine'"),
])
def test_per_block_patches_and_model_wrappers_are_refused_by_name(opts, named):
    with pytest.raises(FluxAccelError, match=f"would ignore per-block patches: {named}"):
        options.refuse_unsupported(opts, {}, None)


