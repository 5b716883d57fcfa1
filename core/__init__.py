"""FluxAccel core: the logic behind the nodes, importable without a running ComfyUI server (docs/ARCHITECTURE.md).

  models/    what a FLUX model is: recognising it, meeting current ComfyUI's loaders, synthetic random-weight models
  quant/     FP8: config and numerics (torchao), the FP8 Linear as ComfyUI runs it, patching a ModelPatcher clone
  compile/   each kind of FLUX block compiled once, each call captured: config, shape policy, runner, telemetry
  cache/     every file FluxAccel keeps: compiled kernels, warm-start packages, FP8 weights
  bench/     the side-by-side measurement, its fidelity metrics, chart and result files
  upstream/  every private name of ComfyUI, torch and torchao, feature-detected
  env, errors, patches -- what this process can do, FluxAccelError, what FluxAccel applied to a model
"""
