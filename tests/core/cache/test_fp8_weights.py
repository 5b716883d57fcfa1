"""core/cache/fp8_weights.py: Quantize FP8 loads a model's FP8 weights from the cache instead of quantizing again,
with the same numbers; stale, foreign and corrupt files are ignored with a warning; what is not cached says why."""
import os
import shutil
import threading

import pytest
import torch

from fluxaccel.core.quant import build as fp8_build
from fluxaccel.core.quant.source import Linears
from fluxaccel.core.cache import fp8_weights as weights_cache
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.runs import denoise_once
from support.shapes import TINY



@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path / "cache"))
    yield weights_cache.cache_dir()
    weights_cache.wait()


@pytest.fixture
def tiny_file(tmp_path):
    from support.models import write_flux_file

    return write_flux_file(tmp_path / "tiny.safetensors", TINY)


def load(path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16})


@pytest.fixture
def quantizations(monkeypatch):
    """How many Linears torchao quantized (the real quantize_linear, counted)."""
    calls = []
    real = fp8_build.quantize_linear
    monkeypatch.setattr(fp8_build, "quantize_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_restart_loads_the_fp8_weights_instead_of_quantizing(cpu_fp8, cache, tiny_file, quantizations):
    first, report = apply_fp8(load(tiny_file), Fp8Config())
    weights_cache.wait()
    assert report.weights_cache.startswith("saving to") and len(list(cache.glob("*.safetensors"))) == 1
    assert len(quantizations) == len(report.quantized) > 1
    quantizations.clear()
    again, report2 = apply_fp8(load(tiny_file), Fp8Config())  # a new load of the file, as after a restart
    assert report2.weights_cache.startswith(f"loaded {len(report2.quantized) - 1} Linears")
    assert len(quantizations) == 1  # only the first, checked against the file
    assert report2.quantized == report.quantized and report2.bytes_after == report.bytes_after
    assert torch.equal(denoise_once(again, hw=8), denoise_once(first, hw=8))
    per_tensor, report3 = apply_fp8(load(tiny_file), Fp8Config(granularity="per_tensor"))  # another config: own file
    weights_cache.wait()
    assert report3.weights_cache.startswith("saving to") and len(list(cache.glob("*.safetensors"))) == 2


def test_a_changed_source_file_is_a_new_entry(cpu_fp8, cache, tiny_file):
    _, report = apply_fp8(load(tiny_file), Fp8Config())
    weights_cache.wait()
    st = tiny_file.stat()
    os.utime(tiny_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file replaced by another of equal size
    _, report2 = apply_fp8(load(tiny_file), Fp8Config())
    assert report2.weights_cache.startswith("saving to") and report2.weights_cache != report.weights_cache


@pytest.mark.parametrize("damage", ["truncated", "foreign", "other numbers"])
def test_unusable_files_are_ignored_with_a_warning(cpu_fp8, cache, tiny_file, tmp_path, damage, caplog):
    _, report = apply_fp8(load(tiny_file), Fp8Config())
    weights_cache.wait()
    (path,) = cache.glob("*.safetensors")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "foreign":  # another model's file under this model's name (copied from elsewhere)
        other = write_other(tmp_path)
        _, rep = apply_fp8(load(other), Fp8Config())
        weights_cache.wait()
        shutil.copy(next(p for p in cache.glob("*.safetensors") if p != path), path)
    else:  # the key matches, the data does not (written by a FluxAccel whose numerics differed)
        from safetensors.torch import load_file, save_file
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        first = next(k for k in tensors if k.endswith(".scale"))
        tensors[first] = tensors[first] * 2
        save_file(tensors, str(path), metadata=meta)
    ref = denoise_once(apply_fp8(load(tiny_file), Fp8Config(granularity="per_tensor"))[0], hw=8)  # unrelated entry
    with caplog.at_level("WARNING", "fluxaccel.fp8"):
        model, report2 = apply_fp8(load(tiny_file), Fp8Config())
    words = {"truncated": "ignoring the FP8 weights cache file", "foreign": "its key is not this model's",
             "other numbers": "holds other numbers than quantizing gives now"}[damage]
    assert any(words in r.getMessage() for r in caplog.records)
    assert report2.weights_cache.startswith("saving to")  # quantized, and written again
    weights_cache.wait()
    assert apply_fp8(load(tiny_file), Fp8Config())[1].weights_cache.startswith("loaded")
    assert not torch.equal(denoise_once(model, hw=8), ref)  # per_row's numbers, not the other entry's


def write_other(tmp_path):
    from support.models import write_flux_file

    return write_flux_file(tmp_path / "other.safetensors", TINY, seed=1)


def test_what_is_not_cached_says_why(cpu_fp8, cache, tiny_file, tiny_flux, monkeypatch):
    assert apply_fp8(tiny_flux, Fp8Config())[1].weights_cache == "not cached: no weights file is known for this model"
    lora = load(tiny_file)
    lora.add_patches({"diffusion_model.double_blocks.0.img_attn.qkv.weight":
                      (torch.zeros_like(lora.model.diffusion_model.double_blocks[0].img_attn.qkv.weight),)}, 0.5)
    assert "1 weight patches (LoRA, ...) are merged" in apply_fp8(lora, Fp8Config())[1].weights_cache
    monkeypatch.setenv("FLUXACCEL_FP8_CACHE", "0")
    assert apply_fp8(load(tiny_file), Fp8Config())[1].weights_cache == "not cached: $FLUXACCEL_FP8_CACHE=0"
    assert not list(cache.glob("*.safetensors"))


def test_workers_writing_the_same_entry_leave_one_whole_file(cpu_fp8, cache, tiny_file):
    model = load(tiny_file)
    entry = weights_cache.entry_for(Linears(model, {}, [], {}), Fp8Config())
    shape = (64, 32)
    tensors = {f"l{i}": {"weight": torch.randn(shape).to(torch.float8_e4m3fn), "scale": torch.rand(shape[0], 1)}
               for i in range(8)}
    writers = [threading.Thread(target=weights_cache.save, args=(entry, tensors)) for _ in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    weights_cache.wait()
    got = weights_cache.load(entry, {n: shape for n in tensors})
    assert got is not None and all(torch.equal(got[n]["scale"], tensors[n]["scale"]) for n in tensors)
    assert [p.name for p in cache.iterdir()] == [entry.path.name]  # no temporary file left


def test_the_oldest_files_go_over_the_bound(cpu_fp8, cache, tiny_file, monkeypatch):
    monkeypatch.setenv("FLUXACCEL_FP8_CACHE_MAX_GIB", "0")  # every file but the newest is over the bound
    apply_fp8(load(tiny_file), Fp8Config())
    weights_cache.wait()
    apply_fp8(load(tiny_file), Fp8Config(granularity="per_tensor"))
    weights_cache.wait()
    assert len(list(cache.glob("*.safetensors"))) == 1


@pytest.mark.parametrize("readers,chunk", [(1, 1 << 20), (3, 40), (4, 7)])
def test_read_tensors_gives_what_safetensors_reads(tmp_path, readers, chunk):
    """Tensors straddling chunks and readers' parts, of several dtypes and odd sizes: each equal to what safetensors
    reads, in memory of its own (a partial unload can free each)."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(13, 7, generator=g).to(torch.float8_e4m3fn),
               "a.scale": torch.rand(13, 1, generator=g), "b.weight": torch.randn(5, 3, generator=g).bfloat16(),
               "b.scale": torch.rand((), generator=g), "c.weight": torch.randn(64, 33, generator=g).to(torch.float8_e4m3fn)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    header, start = weights_cache._header(path)
    header.pop("__metadata__", None)
    got = weights_cache.read_tensors(path, start, header, torch.device("cpu"), readers=readers, chunk=chunk)
    ref = load_file(str(path))
    assert set(got) == set(ref)
    for k, t in got.items():
        assert t.dtype == ref[k].dtype and t.shape == ref[k].shape
        assert torch.equal(t.reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got)


def test_read_tensors_says_a_file_cut_short(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"w": torch.ones(1000)}, str(path))
    header, start = weights_cache._header(path)
    header.pop("__metadata__", None)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(EOFError, match="100 bytes early"):
        weights_cache.read_tensors(path, start, header, torch.device("cpu"), readers=2, chunk=256)


def test_loaded_weights_are_read_in_inference_mode_as_comfyui_runs_nodes(cpu_fp8, cache, tiny_file):
    apply_fp8(load(tiny_file), Fp8Config())
    weights_cache.wait()
    with torch.inference_mode():
        model, report = apply_fp8(load(tiny_file), Fp8Config())
    assert report.weights_cache.startswith("loaded") and " in " in report.weights_cache
