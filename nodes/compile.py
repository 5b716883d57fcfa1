from comfy_api.latest import io, ui

from ..core.compile.config import (ATTENTIONS, GRAPH_CAPTURES, MODES, MODULATION_TABLES, POLICIES, SINGLE_BLOCKS,
                                   CompileConfig)
from ..core.compile.patch import apply_compile
from . import ids
from .events import compiled_notifier, progress_text
from .validation import accept_all_inputs, refuse_unknown_inputs


class Compile(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.COMPILE,
            display_name="Compile + CUDA Graph (FluxAccel)",
            category=ids.CATEGORY,
            description="torch.compile of the whole FLUX diffusion model with CUDA graphs, for fixed-shape latents "
                        "(graph_capture 'call': each kind of block compiled on its own, each model call captured). "
                        "Put it after Quantize FP8; add Warmup to compile before the first prompt.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.1, FLUX.2 or Chroma model, optionally FP8-quantized by FluxAccel."),
                io.Boolean.Input("cuda_graphs", default=True,
                                 tooltip="Capture CUDA graphs (removes kernel-launch overhead). With graph_capture "
                                         "'auto' (the default) they run under any allocator where a C++ compiler is "
                                         "found; 'inductor' needs ComfyUI started with --disable-cuda-malloc. Where "
                                         "they cannot run, the model compiles without graphs and says so here and on "
                                         "the badge."),
                io.Combo.Input("mode", options=list(MODES), default="default",
                               tooltip="default: fast compile. tuned-kernels: tune the generated kernels' block "
                                       "sizes at the first run (FLUX.1-dev on an H200: 3.5 % faster per step; the "
                                       "first compile about 45 s longer, and about 15 s of tuning again after each "
                                       "restart). max-autotune(-no-cudagraphs): also benchmark GEMM choices at "
                                       "compile time (much longer first run)."),
                io.Combo.Input("resolution_policy", options=list(POLICIES), default="strict",
                               tooltip="strict: any other batch/resolution/prompt length is an error. recompile: "
                                       "compile each new shape, up to max_shapes. eager_fallback: run other shapes "
                                       "uncompiled, with a warning."),
                io.Int.Input("max_shapes", default=4, min=1, max=64,
                             tooltip="With resolution_policy recompile: how many shapes may be compiled."),
                io.Boolean.Input("persistent_cache", default=True, optional=True,
                                 tooltip="Save compile artifacts in ComfyUI's user folder (fluxaccel/compile-cache) and "
                                         "reload them after a restart, so the first image needs little compile time."),
                io.Boolean.Input("block_regions", default=True, optional=True,
                                 tooltip="Compile each kind of FLUX block once and reuse it for the other 18/37 "
                                         "(torch nested compile regions) inside the one whole-model graph: about half "
                                         "the compile time (H200: 42 vs 73 s); CUDA graphs still cover the whole "
                                         "model. Costs 2-3 % per step at 1024². Needs Quantize FP8 layout 'plain'."),
                io.Combo.Input("attention", options=list(ATTENTIONS), default="cudnn", optional=True,
                               tooltip="cudnn: bf16 attention through PyTorch SDPA, cuDNN first. fp8: FlashAttention-3's "
                                       "FP8 kernel (Hopper GPUs; pip install fa3-fwd), Q/K/V cast to FP8 inside the "
                                       "compiled graph: H200, FLUX.1-dev 1024² 28 steps: 2.33 vs 2.55 s per prompt, "
                                       "denoiser error 0.062 vs 0.054 (Benchmark shows it). Refused where it cannot "
                                       "run."),
                io.Boolean.Input("separate_process", default=True, optional=True,
                                 tooltip="A shape not compiled before compiles in a separate process while this model "
                                         "runs uncompiled (the badge counts those calls); the compiled model takes "
                                         "over at the first model call after it is ready. The first image comes at "
                                         "uncompiled speed instead of waiting about a minute for the compile. Needs "
                                         "the model's size once more in free GPU memory while it compiles (else it "
                                         "compiles in the first call, and says so) and persistent_cache. Warmup and "
                                         "Benchmark always compile before they run."),
                io.Combo.Input("single_blocks", options=list(SINGLE_BLOCKS), default="fluxaccel", optional=True,
                               tooltip="fluxaccel: with block_regions, single blocks whose linear2 takes Quantize FP8's "
                                       "fused GELU run FluxAccel's copy of ComfyUI's forward that quantizes linear2's "
                                       "input from the attention output and the MLP stream where they are, instead "
                                       "of writing their concatenation first (same numbers; H200, FLUX.1-dev blocks: "
                                       "1.7 ms less per step). Only for the ComfyUI forward FluxAccel has read; "
                                       "otherwise ComfyUI's runs and this node's text says so. comfyui: always "
                                       "ComfyUI's forward."),
                io.Combo.Input("graph_capture", options=list(GRAPH_CAPTURES), default="auto", optional=True,
                               tooltip="auto: 'call' on a GPU where a C++ compiler is found, else 'inductor'. call: "
                                       "each kind of block compiled on its own (inductor's C++ wrapper) and every "
                                       "model call captured whole, under any allocator (H200, FLUX.1-dev 1024² 28 "
                                       "steps: 2.49 vs 2.53 s per prompt without graphs; schnell 512² 4 steps: 0.112 "
                                       "vs 0.19 s). Its first compile runs in a separate process too (FLUX.1-dev: "
                                       "39 s), and a restart loads each block kind's package in a few seconds. "
                                       "inductor: inductor's CUDA graphs over the whole-model compile (needs "
                                       "--disable-cuda-malloc)."),
                io.Boolean.Input("stage_inputs", default=True, optional=True,
                                 tooltip="Copy the sampler's CPU inputs (the conditioning, rebuilt by ComfyUI for "
                                         "every model call) to the GPU through pinned memory without waiting for the "
                                         "GPU, so the host prepares the next call while the GPU runs this one. Same "
                                         "values. Off: ComfyUI's own copy, which waits for the GPU at every call."),
                io.Combo.Input("modulation_table", options=list(MODULATION_TABLES), default="auto", optional=True,
                               tooltip="FLUX.1: compute every block's modulation (shift, scale, gate) once per "
                                       "prompt for all of the sampler's sigmas and look it up at each step, instead "
                                       "of reading all modulation weights at every step (FLUX.1-dev: 6.4 GB per step; "
                                       "H200 1024² 28 steps: 22-41 ms less per prompt, 55-58 ms with attention fp8). "
                                       "Holds 64 rows on the GPU (FLUX.1-dev: 134 MB). A call at another sigma "
                                       "computes its own (counted in the stats). auto: on where the model allows it "
                                       "(not with FP8 modulation weights or a LoRA on them; said here); on: refused "
                                       "where it cannot run; off."),
            ],
            outputs=[io.Model.Output(tooltip="The model, compiled on first use; the input model is unchanged.")],
            hidden=[io.Hidden.unique_id],
            **accept_all_inputs(io.Schema, "Compile"),  # an input this node no longer has: refused by name
        )

    @classmethod
    def execute(cls, model, cuda_graphs, mode, resolution_policy, max_shapes, persistent_cache=True,
                block_regions=True, attention="cudnn", separate_process=True, single_blocks="fluxaccel",
                graph_capture="auto", stage_inputs=True, modulation_table="auto", **unknown) -> io.NodeOutput:
        refuse_unknown_inputs(unknown)
        cfg = CompileConfig(cuda_graphs=cuda_graphs, mode=mode, resolution_policy=resolution_policy,
                            max_shapes=max_shapes, persistent_cache=persistent_cache,
                            block_regions=block_regions, attention=attention, separate_process=separate_process,
                            single_blocks=single_blocks, graph_capture=graph_capture, stage_inputs=stage_inputs,
                            modulation_table=modulation_table)
        clone, compiled = apply_compile(model, cfg)
        compiled.on_compiled = compiled_notifier(cls.hidden.unique_id)
        compiled.on_progress = progress_text(cls.hidden.unique_id)
        text = "\n".join([compiled.cfg.summary(), *(d.line() for d in compiled.stats.degradations)])
        return io.NodeOutput(clone, ui=ui.PreviewText(text))
