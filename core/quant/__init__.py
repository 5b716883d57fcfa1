"""FP8: config and numerics (fp8.py), the FP8 Linear as ComfyUI runs it (linear.py), a ModelPatcher clone (patch.py)."""
