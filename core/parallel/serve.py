"""One sequence-parallel worker's loop (started by worker.py in its own process, one per GPU): it joins the workers'
process group, rebuilds the diffusion model from its skeleton on its device, takes its weights (all of them once,
then those that changed), and runs each model call it is sent with its share of the tokens (sequence.py). Rank 0
sends the output back; every rank answers each message, with the error where one happened.

Messages from ComfyUI's process (wire.py): ("model", skeleton, weights),
("weights", weights), ("call", inputs), ("stop",). Answers: ("ok", rank, output or None) or ("error", rank, text).
"""
from __future__ import annotations

import datetime
import logging
import traceback
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

from ..compile import skeleton
from ..compile.blocks import BlockTable
from ..compile.config import CompileConfig
from ..compile.reductions import persistent
from ..compile.rope import torch_rope
from ..compile.runner import one_graph, recompile_budget
from ..upstream import torch_internals
from .sequence import SequenceParallel
from .wire import recv, send

log = logging.getLogger("fluxaccel.parallel")


def run(job: dict) -> int:
    rank, world = job["rank"], job["world"]
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn = Client(job["address"], authkey=bytes.fromhex(job["authkey"]))
    send(conn, ("ok", rank, None))  # before the group forms: ComfyUI's process accepts one worker at a time
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=job["init_method"], rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=job["timeout_s"]))
    dm = sp = None
    try:
        while True:
            msg = recv(conn)
            try:
                if msg[0] == "stop":
                    return 0
                if msg[0] == "model":
                    dm, sp = skeleton.loads(msg[1], device), None
                    _load(dm, msg[2], device)
                    out = None
                elif msg[0] == "weights":
                    _load(dm, msg[1], device)
                    out = None
                else:
                    sp = sp or _parallel(dm, rank, world, job["compile_blocks"])
                    out = _call(dm, sp, msg[1], device)
                send(conn, ("ok", rank, out if rank == 0 else None))
            except Exception:  # noqa: BLE001 -- every error goes back to ComfyUI's process, which says it
                send(conn, ("error", rank, traceback.format_exc(limit=8)))
    finally:
        dist.destroy_process_group()


def _load(dm: torch.nn.Module, weights: dict, device: torch.device) -> None:
    """Copy `weights` (name -> tensor, as state_dict names them) into the model's tensors."""
    tensors = {**dict(dm.named_parameters()), **dict(dm.named_buffers())}
    with torch.no_grad():
        for name, t in weights.items():
            tensors[name].copy_(t.to(device))


def _parallel(dm: torch.nn.Module, rank: int, world: int, compile_blocks: bool) -> SequenceParallel:
    """This worker's block replacements for `dm`: each block kind compiled once (FluxAccel's BlockTable, without the
    call's capture) where `compile_blocks`, else ComfyUI's own block code."""
    blocks = BlockTable(dm, CompileConfig().inductor_options(capture=False)) if compile_blocks else None
    return SequenceParallel(rank, world, len(dm.double_blocks), len(dm.single_blocks), blocks=blocks)


def _call(dm: torch.nn.Module, sp: SequenceParallel, inputs: dict, device: torch.device) -> dict:
    """The model call with this rank's share of the tokens: the whole output (every rank has it), and how many
    graphs this worker has compiled so far."""
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else
                [t.to(device) for t in v] if isinstance(v, list) else v) for k, v in inputs["args"].items()}
    with torch.inference_mode(), one_graph(), recompile_budget(), torch_rope(), persistent():
        out = dm(**args, transformer_options=sp.options(inputs["transformer_options"]))
    return {"out": out.cpu(), "compiled_graphs": torch_internals.compiled_graph_count()}
