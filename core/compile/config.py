"""What the Compile node asks for: one small frozen config, validated when made, turned into the options of one
torch.compile call (nothing process-wide)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import FluxAccelError
from ..upstream import torch_internals

MODES: tuple[str, ...] = ("default", "tuned-kernels", "max-autotune-no-cudagraphs", "max-autotune")
# FluxAccel's own mode: inductor tunes the block sizes of the Triton kernels it generates (coordinate descent, at their
# first launch), without max-autotune's GEMM benchmarking. H200, FLUX.1-dev 1024²: 2.71 vs 2.81 s per prompt, the first
# compile ~45 s longer, and ~15 s of tuning again at the first call after a restart (bench/NOTES.md).
OWN_MODES: dict[str, dict] = {"tuned-kernels": {"coordinate_descent_tuning": True}}
POLICIES: tuple[str, ...] = ("strict", "recompile", "eager_fallback")
ATTENTIONS: tuple[str, ...] = ("cudnn", "fp8")  # fp8: FlashAttention-3's FP8 kernel (fp8_attention.py), opt-in
SINGLE_BLOCKS: tuple[str, ...] = ("fluxaccel", "comfyui")  # whose single-block forward the regions run
GRAPH_CAPTURES: tuple[str, ...] = ("auto", "inductor", "call")
MODULATION_TABLES: tuple[str, ...] = ("auto", "on", "off")


@dataclass(frozen=True)
class CompileConfig:
    cuda_graphs: bool = True
    mode: Literal["default", "tuned-kernels", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    resolution_policy: Literal["strict", "recompile", "eager_fallback"] = "strict"
    max_shapes: int = 4
    persistent_cache: bool = True
    # with persistent_cache: each shape's trace saved as a warm-start package (warm_start.py), so a restarted ComfyUI
    # does not trace the model again; off: only inductor's artifacts are kept (compile_cache.py)
    warm_start: bool = True
    block_regions: bool = True  # H200 dev-1024-28: compile 73 -> 42 s, steady state +2-3 % (bench/NOTES.md)
    attention: Literal["cudnn", "fp8"] = "cudnn"
    # a shape not compiled before compiles in a separate process while the model runs uncompiled (separate.py); needs
    # the warm-start packages (persistent_cache and warm_start), which carry the compiled call back
    separate_process: bool = False
    # "fluxaccel": in the block regions, single blocks whose linear2 takes Quantize FP8's fused GELU run FluxAccel's
    # forward, which never writes linear2's concatenated input (single_block.py); "comfyui": the block's own forward
    single_blocks: Literal["fluxaccel", "comfyui"] = "fluxaccel"
    # who makes the CUDA graphs: "inductor" -- its cudagraph trees over the whole-model compile, which need PyTorch's
    # native allocator (ComfyUI --disable-cuda-malloc); "call" -- each kind of block compiled on its own with
    # inductor's C++ wrapper and each model call captured whole by FluxAccel (call_graphs.py), under any allocator
    # (ComfyUI's default cudaMallocAsync included), a warm-start package per block kind; "auto" -- "call" where it can
    # run (a CUDA device with graphs on, block_regions, a C++ compiler), "inductor" elsewhere (patch.resolve_capture)
    graph_capture: Literal["auto", "inductor", "call"] = "auto"
    # the sampler's CPU inputs (the conditioning) copied to the GPU through pinned memory without the host waiting
    # (staging.py); off: ComfyUI's own blocking copy in every model call
    stage_inputs: bool = True
    # every block modulation computed once per prompt for all of the sampler's sigmas, looked up at each call
    # (mod_table.py): "auto" where the model allows it (said where not), "on" (refused where not), "off"
    modulation_table: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise FluxAccelError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.resolution_policy not in POLICIES:
            raise FluxAccelError(f"resolution_policy must be one of {POLICIES}, got {self.resolution_policy!r}")
        if self.attention not in ATTENTIONS:
            raise FluxAccelError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.single_blocks not in SINGLE_BLOCKS:
            raise FluxAccelError(f"single_blocks must be one of {SINGLE_BLOCKS}, got {self.single_blocks!r}")
        if self.graph_capture not in GRAPH_CAPTURES:
            raise FluxAccelError(f"graph_capture must be one of {GRAPH_CAPTURES}, got {self.graph_capture!r}")
        if self.modulation_table not in MODULATION_TABLES:
            raise FluxAccelError(f"modulation_table must be one of {MODULATION_TABLES}, got {self.modulation_table!r}")
        if self.captured and not self.block_regions:
            raise FluxAccelError("graph_capture 'call' compiles each kind of FLUX block on its own through the block "
                                 "table: turn block_regions on, or set graph_capture to 'inductor'")
        if self.max_shapes < 1:
            raise FluxAccelError(f"max_shapes must be at least 1, got {self.max_shapes}")
        if self.block_regions:
            from .block_regions import available

            if not available():
                raise FluxAccelError(f"block_regions needs torch.compiler.nested_compile_region (torch 2.8 or newer); "
                                     f"this is torch {torch.__version__}. Turn block_regions off.")

    def summary(self) -> str:
        """The config in words (the Compile node's text)."""
        policy = {"strict": "only the first shape (another is an error)",
                  "recompile": f"up to {self.max_shapes} shapes, each compiled when first met",
                  "eager_fallback": "the first shape compiled, others run uncompiled (counted)"}[self.resolution_policy]
        return "; ".join([
            ("each kind of block" if self.captured else "whole model") + ", compiled on first use" +
            (f" (mode {self.mode})" if self.mode != "default" else ""),
            "CUDA graphs " + ("off" if not self.cuda_graphs else "on" if self.graph_capture == "inductor" else
                              "on (each model call captured whole)" if self.graph_capture == "call" else
                              "on (each model call captured whole where a C++ compiler is found)"),
            f"shapes: {policy}",
            ("the model around the blocks uncompiled, the blocks through inductor's C++ wrapper" if self.captured
             else "repeated blocks compiled once") if self.block_regions else "every block compiled",
            *(["single blocks without the concatenation before linear2 where Quantize FP8 fused the GELU"]
              if self.block_regions and self.single_blocks == "fluxaccel" else []),
            *(["FP8 attention (FlashAttention-3), Q/K scales " + ("from the QK-norm bound" if self.block_regions
                                                                   else "per call (block_regions off)")]
              if self.attention == "fp8" else []),
            ("compile cache on" + (" with warm start" if self.warm_start else "")) if self.persistent_cache
            else "no compile cache (compiles again after a restart)",
            "a new shape compiles in a separate process while the model runs uncompiled" if self.separate_process
            else "a new shape compiles in its first call",
            "the sampler's CPU inputs copied to the GPU without waiting for it" if self.stage_inputs
            else "the sampler's CPU inputs copied by ComfyUI (the host waits for the GPU at every call)",
            *(["block modulations computed once per prompt for all of the sampler's sigmas" +
               (" where the model allows it" if self.modulation_table == "auto" else "")]
              if self.modulation_table != "off" else [])])

    @property
    def captured(self) -> bool:
        """CUDA graphs by FluxAccel's own capture of each call, the blocks compiled on their own (graph_capture)."""
        return self.cuda_graphs and self.graph_capture == "call"

    @property
    def nested_regions(self) -> bool:
        """Whether the repeated blocks are nested compile regions inside the whole-model compile (with graph_capture
        "call" they are compiled on their own instead: inductor's C++ wrapper cannot compile nested regions)."""
        return self.block_regions and not self.captured

    def inductor_options(self, device: torch.device) -> dict:
        """Options passed to this torch.compile call only (no process-wide inductor/dynamo config changes).

        torch.compile takes either mode or options; a mode is expanded to its options so that CUDA graphs can be
        switched on or off on top of it. Graphs are CUDA-only: on other devices the option is left off.
        """
        opts = {}
        if self.mode in OWN_MODES:
            opts = dict(OWN_MODES[self.mode])
        elif self.mode != "default":
            opts = torch_internals.mode_options(self.mode)
            if not opts:
                raise FluxAccelError(f"mode {self.mode!r} cannot be expanded to inductor options here ({opts}); "
                                     f"set mode to 'default' on the Compile node.")
        graphs = bool(self.cuda_graphs and torch.device(device).type == "cuda")
        opts["triton.cudagraphs"] = graphs and not self.captured
        if graphs and self.captured:
            opts["cpp_wrapper"] = True  # kernels launched from C++: the call can be captured under cudaMallocAsync
            # A GPU graph's wrapper needs no CPU vector ISA (a CPU kernel in it would run unvectorized, still
            # correct). torch 2.11 picks one anyway, checking each candidate by building a test library and loading
            # it in a new Python process: ~30 s in every process that compiles or loads such a graph (bench/NOTES.md).
            # Newer torch skips the check for GPU code; this does the same here. The ISA list inductor computes under
            # it is dropped after FluxAccel's compile or load (torch_internals.vec_isa_list_kept).
            opts["cpp.vec_isa_ok"] = False
        # Round bf16 intermediates as eager does. Without it inductor keeps e.g. guidance * 1000 in float32 (3500)
        # where eager rounds it to bf16 (3504): FLUX's sinusoidal embeddings turn that into a different output
        # (35 % relative error on the tiny test model, 0.7 % with this option).
        opts["emulate_precision_casts"] = True
        return opts
