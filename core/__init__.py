"""FluxAccel core: the logic behind the nodes, importable without a running ComfyUI server.

Modules hold one idea each:
  errors         -- FluxAccelError, the exception whose text ComfyUI shows in the UI
  env            -- what this process can do: torch/torchao present and recent, GPU capability
  comfy_compat   -- where current ComfyUI's features are met: dynamic VRAM's resident delegate, core's graphs,
                    checkpoint-quantized weights
  flux           -- recognising a FLUX ModelPatcher and refusing what we cannot accelerate
  fp8            -- tensor-level FP8: config, layer selection by name, quantizing one Linear, the FP8 linear
  fp8_patch      -- module-level FP8: quantized Linears as object patches of a ModelPatcher clone
  compile        -- the compiled whole-model FLUX call: config, shape contract, stats
  compile_patch  -- putting a CompiledFlux into a ModelPatcher clone (keyed APPLY_MODEL wrapper)
  compile_cache  -- the persistent compile cache (inductor artifacts per model/config/versions)
  block_regions  -- nested compile regions for FLUX's repeated blocks
  attention, rope -- what the compiled call runs for attention and RoPE
  warmup         -- sampling at each shape before the first prompt
  bench, chart   -- the side-by-side measurement and its chart
  patches        -- label, description and removal of what FluxAccel applied to a model
  metrics        -- fidelity measures (relative error, SQNR)
  test_models    -- random-weight FLUX models, files and synthetic conditioning for tests and benchmarks
"""
