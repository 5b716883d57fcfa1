"""A ComfyUI custom node of FluxAccel's tests and tools, never of the plugin: loaded only by servers that
tools/comfy_server.py starts with cpu_fp8=True (through the extra_model_paths.yaml it writes), it lifts torchao's FP8
hardware gate in that CPU server (tools/cpu_fp8.py) and adds no nodes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the project root, for tools/
from tools.cpu_fp8 import lift_torchao_gate  # noqa: E402

lift_torchao_gate()
NODE_CLASS_MAPPINGS: dict = {}
