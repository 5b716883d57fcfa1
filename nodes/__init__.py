from comfy_api.latest import ComfyExtension

from .benchmark import Benchmark
from .compile import Compile
from .conditioning import SyntheticConditioning
from .quantize import QuantizeFP8
from .warmup import Warmup

NODES = [QuantizeFP8, Compile, Warmup, Benchmark, SyntheticConditioning]


class FluxAccelExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
