"""CompileConfig.dynamic_tokens: the token count a dynamic dimension of the block kernels, so one compile of each
block kind serves every image size and prompt length (each new shape only captures its CUDA graph on a GPU), and the
output equals the uncompiled model's at every size (float32). Without it, each token count is a compile of its own."""
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from support.models import build_flux
from support.runs import clear_compile_counters, compiled_graphs, denoise_once

SIZES = ((16, None, 16), (14, 18, 7), (10, 16, 12))  # 64, 63 and 40 image tokens; 16, 7 and 12 text tokens


def _graphs_per_size(cfg: CompileConfig) -> list[int]:
    base = build_flux("tiny", dtype=torch.float32)
    model, compiled = apply_compile(base, cfg)
    clear_compile_counters()
    graphs = []
    for hw, w, text in SIZES:
        out, ref = denoise_once(model, hw=hw, w=w, text_len=text), denoise_once(base, hw=hw, w=w, text_len=text)
        assert rel_err(out, ref) < 1e-4, (hw, w, text)
        graphs.append(compiled_graphs())
    assert compiled.stats.eager_calls == 0
    return graphs


def test_one_compile_of_each_block_kind_serves_every_token_count(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path))
    assert _graphs_per_size(CompileConfig(separate_process=False, dynamic_tokens=True)) == [2, 2, 2]


def test_without_it_each_token_count_compiles_again(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path))
    graphs = _graphs_per_size(CompileConfig(separate_process=False, persistent_cache=False))
    assert graphs[0] == 2 and graphs[-1] > graphs[0]


def test_the_environment_switch_and_what_it_turns_off(monkeypatch):
    from fluxaccel.core.errors import FluxAccelError
    import pytest

    monkeypatch.setenv("FLUXACCEL_DYNAMIC_TOKENS", "1")
    cfg = CompileConfig.from_inputs({}, "Compile")
    assert cfg.dynamic_tokens and not cfg.separate_process
    with pytest.raises(FluxAccelError, match="dynamic_tokens compiles in the call"):
        CompileConfig(dynamic_tokens=True, separate_process=True)
