"""tools/first_prompts.py end to end on the CPU: a real ComfyUI server, then the same machine's ComfyUI restarted. The
restarted server's FluxAccel prompt reads the FP8 weights the first server saved and loads the warm-start package
instead of quantizing and compiling again (ComfyUI's own log says so)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from tools.bench import CASES

pytestmark = pytest.mark.e2e


def test_first_prompts_of_a_fresh_and_a_restarted_comfyui(tmp_path, e2e_model_file):
    # a new machine: FluxAccel's cache and inductor's both empty (the JSON's start says "fresh" only then)
    env = {**__import__("os").environ, "FLUXACCEL_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "first_prompts.py"), "--case", "tiny-cpu", "--configs",
                        "fluxaccel", "eager", "--restart", "--steady", "2", "--split", "--profile-extra", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = {s: json.loads((tmp_path / "out" / f"cpu-tiny-cpu-first-prompts-fluxaccel-eager-{s}.json").read_text())
            for s in ("fresh", "restart")}
    for start, res in runs.items():
        assert res["start"] == start and res["complete"] and res["command"].startswith("python tools/first_prompts.py")
        assert [r["config"] for r in res["results"]] == ["fluxaccel", "eager"]
        # the Compile node's own text: what it compiled (graph_capture auto is 'inductor' on the CPU: the whole model)
        assert res["results"][0]["compile_text"].startswith("whole model, compiled on first use")
        assert "compile_text" not in res["results"][1]
        assert all(r["first_prompt_s"] > 0 and r["second_prompt_s"] > 0 for r in res["results"])
        for r in res["results"]:  # --steady 2: two more prompts each, and their median
            assert len(r["steady_prompts_s"]) == 2 and r["steady_median_s"] == pytest.approx(
                sum(r["steady_prompts_s"]) / 2, abs=0.002)
        assert res["host_memory"]["server_peak_rss_gib"] > 0
        for r in res["results"]:  # --split: each steady prompt timed inside the server (tools/prompt_split_node)
            assert len(r["steady_splits"]) == 2
            for split, comfy_s in zip(r["steady_splits"], r["steady_prompts_s"]):
                assert split["model_calls"] == CASES["tiny-cpu"]["steps"]  # cfg 1: one call per step
                assert split["prompt_s"] == pytest.approx(comfy_s, abs=0.05)  # ComfyUI's own span of the prompt
                assert 0 < split["calls_host_s"] < split["sample_s"] < split["nodes_s"]["KSampler"] < split["prompt_s"]
                assert split["load_models_gpu_s"] < split["sample_s"] and "SaveLatent" in split["nodes_s"]
                assert split["first_call_host_s"] < split["last_return_host_s"] < split["prompt_s"]
                assert split["gpu"] is None
            assert r["steady_split"]["gpu"] == "no CUDA device: the GPU's side cannot be told"
            # --profile-extra: one more prompt after the steady ones, profiled (its Python functions, torch's ops;
            # no GPU, so no kernels); the steady prompts were not
            assert r["last_steady_profile"] is None
            prof = r["profiled_prompt"]
            assert prof["model_calls"] == CASES["tiny-cpu"]["steps"] and prof["prompt_s_under_profilers"] > 0
            assert any("execute_async" in row[0] for row in prof["python"])
            assert any("common_ksampler" in row[0] for row in prof["python"])
            assert any(row[0].startswith("aten::") for row in prof["torch"])
            assert prof["kernels"] == [] and prof["kernels_total_ms"] == 0 and prof["kernel_launches"] == 0
            assert set(prof["kernel_classes"]) == {"gemm", "attention", "triton", "copy", "other"}
            assert r["steady_split"]["model_calls"] == CASES["tiny-cpu"]["steps"]
    logs = {s: (tmp_path / "out" / f"cpu-tiny-cpu-first-prompts-fluxaccel-eager-{s}.comfyui.log").read_bytes()
            .decode(errors="replace") for s in runs}  # bytes: tqdm's carriage returns stay inside their lines
    # fresh: the first prompt ran uncompiled while a separate process compiled the shape; the second loaded its
    # package, the third is the steady state
    fresh = runs["fresh"]["results"][0]
    assert fresh["separate_compile"] == "ready" and fresh["separate_compile_s"] > 0 and fresh["third_prompt_s"] > 0
    assert "FP8 weights cache: saving to" in logs["fresh"] and "in a separate process (pid" in logs["fresh"]
    assert "compiled batch 1" not in logs["fresh"] and "from its warm-start package" in logs["fresh"]
    assert "FP8 weights cache: loaded" in logs["restart"] and "from its warm-start package" in logs["restart"]
    assert "compiled batch 1" not in logs["restart"] and "in a separate process (pid" not in logs["restart"]
    assert "third_prompt_s" not in runs["restart"]["results"][0]
    # the images of the same seed: FP8 compiled against bf16 eager, a few steps of the tiny model
    for res in runs.values():
        assert res["results"][0]["second_latent_rel_err_vs_first_config"] == 0.0
        assert 0 < res["results"][1]["second_latent_rel_err_vs_first_config"] < 0.1
    # every line stamped with the seconds since its server started, in order (where a first prompt's time goes)
    stamps = [float(line.split()[0]) for line in logs["restart"].strip().split("\n") if line.strip()]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]


def test_kernel_kinds_of_an_h200_profile():
    """The profiled prompt's kernels by kind, on kernel names an H200 run recorded: inductor's kernels named after
    the attention op they feed are Triton's, FlashAttention-3's CUTLASS kernel is attention, cuBLAS's are GEMMs."""
    sys.path.insert(0, str(ROOT / "tools" / "prompt_split_node"))
    from fluxaccel_prompt_split import _kernel_tables

    class Ev:  # what torch.profiler's events carry that the tables read
        def __init__(self, name, us):
            from torch.autograd import DeviceType

            self.name, self.device_type = name, DeviceType.CUDA
            self.time_range = type("R", (), {"elapsed_us": lambda _: us})()

    names = {
        "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT": ("gemm", 1000),
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": ("gemm", 10),
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0":
            ("attention", 500),
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Collective>>>":
            ("attention", 300),
        "triton_per_fused__fused_rms_norm__scaled_dot_product_cudnn_attention__to_copy_addcmul_mul_permute_2":
            ("triton", 90),
        "gelu_pair_rowwise_fp8_kernel": ("triton", 80),
        "Memset (Device)": ("copy", 5),
        "void at::native::vectorized_elementwise_kernel<2, at::native::cos_kernel_cuda>": ("other", 1),
    }
    events = [Ev(n, us) for n, (_, us) in names.items() for _ in range(2)]
    tables = _kernel_tables(events, rows=80)
    want = {k: 0.0 for k in ("gemm", "attention", "triton", "copy", "other")}
    for kind, us in names.values():
        want[kind] += 2 * us / 1000
    assert tables["kernel_classes"] == pytest.approx(want)
    assert tables["kernel_launches"] == 16 and tables["kernels_total_ms"] == pytest.approx(2 * 1.986)
    assert tables["kernels"][0] == ["nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT", 2, 2.0]
