"""The messages between ComfyUI's process and its parallel workers (multiprocessing.connection): each pickled here,
tensors by value, never through multiprocessing's shared-memory handles, which need a common parent process."""
from __future__ import annotations

import pickle


def send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())
