"""The one "weights changed" signal: a generation per weight, raised each time the weight is written.

Every copy that runs a model's weights outside ComfyUI's own module tree -- the modulation table built from them, the
Parallel node's workers -- asks this, and nothing else, whether a weight is still what it copied. Writes are counted
where they happen, and only there:
  * ComfyUI's own weight patching of a clone FluxAccel made (patcher.py: patch_weight_to_device, the restore of its
    backups in unpatch_model, its hook patches) raises the BaseModel's generations (`of_model`);
  * an FP8 set merging a clone's patches into one of its Linears in place (quant/store.py) raises that set's own.

A stamp (`Generations.stamp`; a clone's, `patcher.stamp`) names the counter as well as the count, so the same key of two FP8 sets (per_row and per_tensor)
never reads as the same weight. A CUDA graph needs none of this: it reads the weights at their addresses when it
replays, and a write in place keeps them (call_graphs.py compares addresses to see weights that moved).
"""
from __future__ import annotations

import itertools

_SERIAL = itertools.count(1)
ATTR = "_fluxaccel_generations"  # where a BaseModel keeps its Generations (like ComfyUI's current_weight_patches_uuid)


class Generations:
    """How often each weight (state-dict key, 'diffusion_model.…') of one owner has been written; `version` rises with
    every write, for a reader that only needs to know whether anything changed."""

    def __init__(self):
        self.serial = next(_SERIAL)  # which counter this is (never reused in a process)
        self.version = 0
        self._of: dict[str, int] = {}
        # (a BaseModel's, patcher.py) the keys FluxAccel's clones have patched and not restored, and the patches_uuid
        # ComfyUI showed when they last wrote: another patcher's load or unpatch since then may have rewritten them
        self.patched: set[str] = set()
        self.applied = None

    def bump(self, keys) -> None:
        for key in keys:
            self._of[key] = self._of.get(key, 0) + 1
            self.version += 1

    def __getitem__(self, key: str) -> int:
        return self._of.get(key, 0)

    def stamp(self, key: str) -> tuple[int, int]:
        return self.serial, self._of.get(key, 0)


def of_model(base) -> Generations:
    """The generations of the weights ComfyUI patches in this BaseModel's module tree (made at first use)."""
    gens = base.__dict__.get(ATTR)
    if gens is None:
        gens = base.__dict__[ATTR] = Generations()
    return gens
