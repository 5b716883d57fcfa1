"""FluxAccel core: the logic behind the nodes, importable without a running ComfyUI server.

Modules hold one idea each:
  errors      -- FluxAccelError, the exception whose text ComfyUI shows in the UI
  env         -- what this process can do: torchao present and recent, GPU capability
  flux        -- recognising a FLUX ModelPatcher and refusing what we cannot accelerate
  fp8         -- tensor-level FP8: config, layer selection by name, quantizing one Linear
  fp8_patch   -- module-level FP8: applying quantized Linears to a ModelPatcher clone
  metrics     -- fidelity measures (relative error, SQNR)
  test_models -- random-weight FLUX models and synthetic conditioning for tests and benchmarks
"""
