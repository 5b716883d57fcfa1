from comfy_api.latest import ComfyExtension

from .benchmark import Benchmark
from .compile import Compile
from .conditioning import SyntheticConditioning
from .parallel import Parallel
from .quantize import QuantizeFP8
from .warmup import Warmup

NODES = [QuantizeFP8, Compile, Warmup, Benchmark, Parallel, SyntheticConditioning]


class FluxAccelExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
