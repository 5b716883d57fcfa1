"""What the Compile node asks for: one small frozen config, the one home of every default (the node's schema reads
it), validated when made, turned into the options of FluxAccel's torch.compile calls (nothing process-wide).

What FluxAccel can detect it decides and says, rather than asking: CUDA graphs (on a CUDA device where inductor's
C++ wrapper can be built), the modulation table (where the model allows it), the single blocks' fused input, the
staging of the sampler's inputs. The node shows the fields marked `node`; the others are for tools and tests.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..errors import FluxAccelError
from ..inputs import node_field, node_inputs
from ..upstream import Unavailable, torch_internals

# tuned-kernels: inductor tunes the block sizes of the Triton kernels it generates (coordinate descent, at their first
# launch), without max-autotune's GEMM benchmarking; max-autotune: also benchmarks GEMM choices while compiling
MODES: tuple[str, ...] = ("default", "tuned-kernels", "max-autotune")
_MODE_OPTIONS = {"tuned-kernels": lambda: {"coordinate_descent_tuning": True},
                 # FluxAccel captures the CUDA graphs itself: inductor's own are always off
                 "max-autotune": lambda: torch_internals.mode_options("max-autotune-no-cudagraphs")}
POLICIES: tuple[str, ...] = ("recompile", "strict", "eager_fallback")
SEPARATE_ENV = "FLUXACCEL_SEPARATE_COMPILE"  # "0": a new shape compiles in its first call (fleets, tests)
DYNAMIC_ENV = "FLUXACCEL_DYNAMIC_TOKENS"  # "1": CompileConfig.dynamic_tokens
ATTENTIONS: tuple[str, ...] = ("cudnn", "fp8")  # fp8: FlashAttention-3's FP8 kernel (fp8_attention.py), opt-in

# inputs the Compile node had once, which saved workflows may still set: FluxAccel decides them now (one log line)
REMOVED_INPUTS: tuple[str, ...] = ("cuda_graphs", "persistent_cache", "block_regions", "separate_process",
                                   "single_blocks", "graph_capture", "stage_inputs", "modulation_table", "clear_cache")


NODE = "Compile + CUDA Graph (FluxAccel)"
SHAPES_LIMIT = 64  # the most shapes one compiled model may hold (max_shapes; Warmup's resolutions list)


@dataclass(frozen=True)
class CompileConfig:
    resolution_policy: str = dataclasses.field(default="recompile", metadata=node_field())
    max_shapes: int = dataclasses.field(default=4, metadata=node_field(advanced=True))
    attention: str = dataclasses.field(default="cudnn", metadata=node_field(advanced=True))
    mode: str = dataclasses.field(default="default", metadata=node_field(advanced=True))
    # compile artifacts and warm-start packages in the compile-cache folder, loaded after a restart
    persistent_cache: bool = True
    # a shape not compiled before compiles in a separate process while the model runs uncompiled (separate.py);
    # needs persistent_cache, whose packages carry the compiled blocks back. A server started with
    # $FLUXACCEL_SEPARATE_COMPILE=0 compiles a new shape in its first call instead (from_inputs)
    separate_process: bool = True
    # one compile of each block kind serves every token count (the tokens a dynamic dimension of the block kernels):
    # a new size only captures its CUDA graph. Compiles in the call (no per-shape package, no separate process).
    # A server started with $FLUXACCEL_DYNAMIC_TOKENS=1 uses it (from_inputs): for same-server A/B runs.
    dynamic_tokens: bool = False

    def __post_init__(self):
        for name, allowed in (("mode", MODES), ("resolution_policy", POLICIES), ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise FluxAccelError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.dynamic_tokens and self.separate_process:
            raise FluxAccelError("dynamic_tokens compiles in the call: set separate_process to False with it")
        if not 1 <= self.max_shapes <= SHAPES_LIMIT:
            raise FluxAccelError(f"max_shapes must be from 1 to {SHAPES_LIMIT}, got {self.max_shapes}")

    @classmethod
    def from_inputs(cls, inputs: dict, node: str) -> "CompileConfig":
        """The config of a node's inputs: its own fields taken, inputs the node no longer has said in one log line
        (their setting is decided by FluxAccel now), any other name refused."""
        dynamic = os.environ.get(DYNAMIC_ENV, "0") == "1"
        separate = os.environ.get(SEPARATE_ENV, "1") != "0" and not dynamic
        return cls(**node_inputs(cls, inputs, REMOVED_INPUTS, node), separate_process=separate,
                   dynamic_tokens=dynamic)

    def summary(self, capture: str) -> str:
        """The config in words (the Compile node's text). capture: '' where each model call is captured into a CUDA
        graph, else why not."""
        policy = {"strict": "only the first shape (another is an error)",
                  "recompile": f"each new shape compiled when first met, up to {self.max_shapes}; more run uncompiled "
                               f"(counted)",
                  "eager_fallback": "the first shape compiled, others run uncompiled (counted)"}[self.resolution_policy]
        return "; ".join([
            "each kind of FLUX block compiled once, on first use" + (f" (mode {self.mode})" if self.mode != "default"
                                                                      else ""),
            "each model call captured into a CUDA graph" if not capture else f"no CUDA graphs: {capture}",
            f"shapes: {policy}",
            *(["FP8 attention (FlashAttention-3)"] if self.attention == "fp8" else []),
            "compiled shapes saved for the next start" if self.persistent_cache else "no compile cache",
            "a new shape compiles in a separate process while the model runs uncompiled"
            if self.separate_process and self.persistent_cache else
            f"a new shape compiles in its first call{f' (${SEPARATE_ENV}=0)' if not self.separate_process else ''}"])

    def inductor_options(self, capture: bool) -> dict:
        """Options of FluxAccel's torch.compile calls only (no process-wide inductor/dynamo config changes).
        capture: the calls are captured into CUDA graphs by FluxAccel (call_graphs.py)."""
        opts = _MODE_OPTIONS[self.mode]() if self.mode in _MODE_OPTIONS else {}
        if self.mode != "default" and (isinstance(opts, Unavailable) or not opts):
            raise FluxAccelError(f"mode {self.mode!r} cannot be expanded to inductor options here ({opts}); set mode to "
                                 f"'default' on the Compile node.")
        opts = dict(opts)
        opts["triton.cudagraphs"] = False  # FluxAccel captures whole calls (call_graphs.py)
        if capture:
            opts["cpp_wrapper"] = True  # kernels launched from C++: the call can be captured under cudaMallocAsync
            # A GPU graph's wrapper needs no CPU vector ISA; torch 2.11 picks one anyway by building and loading test
            # libraries in new processes, in every process that compiles or loads such a graph. Newer torch skips the
            # pick for GPU code; this does the same here (the list inductor computes under it is dropped after:
            # torch_internals.vec_isa_list_kept).
            opts["cpp.vec_isa_ok"] = False
        # Round bf16 intermediates as eager does: inductor would keep e.g. guidance * 1000 in float32 where eager
        # rounds it to bf16, and FLUX's sinusoidal embeddings amplify the difference.
        opts["emulate_precision_casts"] = True
        return opts
