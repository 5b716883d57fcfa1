"""The messages between ComfyUI's process and its parallel workers (multiprocessing.connection): each serialized here
by torch.save (tensors by value, every dtype FP8 included), never through multiprocessing's shared-memory handles,
which need a common parent process."""
from __future__ import annotations

import io

import torch


def send(conn, msg) -> None:
    buf = io.BytesIO()
    torch.save(msg, buf)
    conn.send_bytes(buf.getbuffer())


def recv(conn):
    return torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)  # from this machine's own ComfyUI process
