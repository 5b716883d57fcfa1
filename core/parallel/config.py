"""What the Parallel node asks for: one small frozen config, the one home of its defaults (the node's schema reads
them)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import FluxAccelError
from ..inputs import node_field, node_inputs


@dataclass(frozen=True)
class ParallelConfig:
    # worker processes, one per GPU: each model call's tokens are split over them
    gpus: int = dataclasses.field(default=2, metadata=node_field())
    # how long a worker may take to start, or to answer one message, before it counts as lost
    timeout_s: float = 600.0
    # each worker compiles each kind of FLUX block once (FluxAccel's block table) around the all-to-all; False:
    # ComfyUI's block code as it is (tests that check the split itself)
    compile_blocks: bool = True

    def __post_init__(self):
        if self.gpus < 2:
            raise FluxAccelError(f"gpus must be at least 2, got {self.gpus}; for one GPU leave the Parallel node out")

    @classmethod
    def from_inputs(cls, inputs: dict, node: str) -> "ParallelConfig":
        return cls(**node_inputs(cls, inputs, (), node))
