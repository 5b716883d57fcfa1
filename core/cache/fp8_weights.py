"""FP8 weights kept on disk: after a restart, Quantize FP8 loads its quantized Linears instead of quantizing again.

One safetensors file per (source file, FP8 config, compute dtype, versions): the FP8 data and
scales of every quantized Linear, named by the Linear. The key holds the source file's path, size, modification
time and a hash of its header (a safetensors file's header names every tensor with its offsets), the FP8 config, the
model's compute dtype and the torch, torchao and FluxAccel versions; the file carries its key in its metadata. A file
whose key, names or shapes do not match what is asked, or that cannot be read, is ignored with a warning and the
Linears are quantized as usual (and saved again). Files are written to a temporary name and renamed into place, so
several ComfyUI workers can share the folder. Not cached: models with weight patches (LoRA)
merged into the quantized Linears, and models that no file identifies (loaded by custom nodes).

Folder: `fp8-weights/` inside FluxAccel's cache folder (folder.default_dir: ComfyUI's user directory, or
$FLUXACCEL_CACHE_DIR; tools/clear_cache.py empties it with the compile cache); $FLUXACCEL_FP8_CACHE=0 turns the cache
off. A file is about half the size of the quantized Linears' bf16 weights (FLUX.1-dev: 8 GiB); the least recently
used files go once the folder holds more than $FLUXACCEL_FP8_CACHE_MAX_GIB (default 64).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .folder import default_dir, file_identity, package_version
from ..upstream import Unavailable, comfy_internals, say, torch_internals

log = logging.getLogger("fluxaccel.fp8")

FORMAT = "fluxaccel-fp8-weights 1"
ENV_OFF, ENV_MAX = "FLUXACCEL_FP8_CACHE", "FLUXACCEL_FP8_CACHE_MAX_GIB"
_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
PARTS = ("weight", "scale")  # biases are read from the model (small; bf16 as loaded)


def cache_dir() -> Path:
    return default_dir() / "fp8-weights"


@dataclass(frozen=True)
class Entry:
    """Where one model's FP8 weights are cached (or why they are not)."""
    key: dict | None
    why_not: str = ""

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:32]
        return cache_dir() / f"{digest}.safetensors"


def entry_for(linears, cfg) -> Entry:
    """The cache entry of a Quantize FP8 run's Linears (quant/source.py) quantized with cfg, or why it has none."""
    if os.environ.get(ENV_OFF, "1") == "0":
        return Entry(None, f"${ENV_OFF}=0")
    if linears.uncached:
        return Entry(None, linears.uncached)
    source, options = comfy_internals.source_file(linears.model), comfy_internals.load_options(linears.model)
    if isinstance(source, Unavailable) or source is None:
        return Entry(None, "no weights file is known for this model" + (f" ({source})" if source is not None else ""))
    try:
        ident = file_identity(source)
    except OSError as e:
        return Entry(None, f"cannot read {source}: {e}")
    return Entry({"format": FORMAT, "source": ident, "fp8": cfg.weights_key(),
                  "compute_dtype": str(linears.compute_dtype), "options": options,
                  "versions": {p: package_version(p) for p in ("torch", "torchao", "comfyui-fluxaccel")}})


def load(entry: Entry, shapes: dict[str, tuple[int, ...]], device: torch.device | str = "cpu", check=None
         ) -> dict[str, dict[str, torch.Tensor]] | None:
    """{linear name: {weight, scale}} from the entry's file, on `device`, or None (absent; stale, foreign or corrupt
    ones with a warning). shapes: each Linear's weight shape, all of which the file must hold. check: (name, an FP8
    Linear quantized now) that the file must hold bit for bit (else it is ignored with a warning, to be saved
    again). The tensors are read straight into memory of their own on `device` (read_tensors): no host copy of them
    is kept."""
    path = entry.path
    if entry.key is None or not path.is_file():
        return None
    try:
        header, start = _header(path)
        if json.loads((header.pop("__metadata__", None) or {}).get("key", "null")) != entry.key:
            raise ValueError("its key is not this model's (a foreign or stale file)")
        for name, shape in shapes.items():
            if any(f"{name}.{p}" not in header for p in PARTS) or tuple(header[f"{name}.weight"]["shape"]) != tuple(shape):
                raise ValueError(f"it does not hold {name} as {tuple(shape)}")
        size = max((h["data_offsets"][1] for h in header.values()), default=0)
        if path.stat().st_size < start + size:
            raise ValueError(f"it is cut short ({path.stat().st_size} bytes, its header names {start + size})")
        tensors = read_tensors(path, start, {f"{n}.{p}": header[f"{n}.{p}"] for n in shapes for p in PARTS},
                               torch.device(device))
        out = {name: {p: tensors[f"{name}.{p}"] for p in PARTS} for name in shapes}
    except Exception as e:  # noqa: BLE001 -- any unreadable file (truncated, foreign, other format) is only skipped
        log.warning("FluxAccel: ignoring the FP8 weights cache file %s (%s: %s); quantizing instead", path,
                    type(e).__name__, e)
        return None
    if check is not None and not _same_fp8(check[1], out[check[0]]):
        log.warning("FluxAccel: the FP8 weights cache file %s holds other numbers than quantizing gives now; "
                    "quantizing instead (and saving again)", path)
        return None
    os.utime(path)  # recently used: pruned last
    return out


def _same_fp8(q, parts: dict) -> bool:
    as_bytes = lambda t: t.detach().cpu().contiguous().view(torch.uint8)  # noqa: E731
    return (torch.equal(as_bytes(q.weight), as_bytes(parts["weight"]))
            and torch.equal(q.fp8_weight_scale.detach().cpu(), parts["scale"].detach().cpu()))


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > 100 << 20:
            raise ValueError(f"its header claims {n} bytes")
        return json.loads(f.read(n)), 8 + n


READERS, CHUNK = 4, 64 << 20  # reading threads, and the bytes each reads and copies at a time


def read_tensors(path: Path, start: int, specs: dict[str, dict], device: torch.device, readers: int = READERS,
                 chunk: int = CHUNK) -> dict[str, torch.Tensor]:
    """The tensors a safetensors header names (specs: name -> its header entry; start: where the data begins), each
    in memory of its own on `device`. Several threads each read their part of the file in chunks into a buffer of
    their own and copy each chunk into the tensors it holds: the reads (page cache or disk) run side by side, and on a
    GPU each buffer is page-locked, so the copies run at the bus's speed (the GIL is free while both run)."""
    dtypes = {v: k for k, v in _DTYPES.items()}
    out, spans = {}, []
    for name, h in specs.items():
        lo, hi = h["data_offsets"]
        t = torch.empty(h["shape"], dtype=dtypes[h["dtype"]], device=device)
        if hi - lo != t.numel() * t.element_size():
            raise ValueError(f"{name} is {hi - lo} bytes, {h['dtype']}{h['shape']} needs {t.numel() * t.element_size()}")
        out[name] = t
        spans.append((lo, hi, t.view(-1).view(torch.uint8)))
    spans.sort(key=lambda s: s[0])
    if not spans:
        return out
    begin, end = spans[0][0], max(s[1] for s in spans)
    step = -(-(end - begin) // max(1, readers))
    parts = [(lo, min(lo + step, end)) for lo in range(begin, end, step)]
    errors: list[BaseException] = []
    inference = torch.is_inference_mode_enabled()  # thread-local: the readers take the caller's

    def work(lo: int, hi: int) -> None:
        try:
            with torch.inference_mode(inference):
                _read_part(path, start, (lo, hi), spans, device, chunk)
        except BaseException as e:  # noqa: BLE001 -- raised again below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=p, name="fluxaccel-fp8-read", daemon=True) for p in parts[1:]]
    for t in threads:
        t.start()
    work(*parts[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _read_part(path: Path, start: int, part: tuple[int, int], spans: list, device: torch.device, chunk: int) -> None:
    """One reader's part [lo, hi) of the data, chunk by chunk, into the tensors each chunk holds."""
    lo, hi = part
    buf = torch.empty(min(chunk, hi - lo), dtype=torch.uint8)
    locked = device.type == "cuda" and _pinned(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf.numpy())
            for pos in range(lo, hi, chunk):
                n = min(chunk, hi - pos)
                _read_at(f.fileno(), view[:n], start + pos)
                for a, b, dest in spans:  # each tensor's bytes in this chunk (synchronous copies: the buffer is
                    x, y = max(a, pos), min(b, pos + n)  # free again after them)
                    if x < y:
                        dest[x - a:y - a].copy_(buf[x - pos:y - pos])
    finally:
        if locked:
            torch_internals.unpin_host(buf)


def _read_at(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):  # a read may return less than asked
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"the file ends at {offset + done}, {len(into) - done} bytes early")
        done += got


def _pinned(buf: torch.Tensor) -> bool:
    ok = torch_internals.pin_host(buf)
    if isinstance(ok, Unavailable):
        say(ok, "the FP8 weights cache is copied to the GPU from pageable memory (slower)", logging.INFO)
    elif not ok:
        say(Unavailable("CUDA", torch.version.cuda or "?", "page-locked buffer", "cudaHostRegister refused"),
            "the FP8 weights cache is copied to the GPU from pageable memory (slower)", logging.INFO)
    return ok is True


def is_ours(path: Path) -> bool:
    """A file this cache wrote (its safetensors header names our format)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return FORMAT.encode() in f.read(min(n, 1 << 24))
    except (OSError, struct.error):
        return False


_writers: list[threading.Thread] = []


def save(entry: Entry, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write the entry's file in the background (the CPU tensors are kept alive until written)."""
    if entry.key is None:
        return
    flat = {f"{name}.{p}": t for name, parts in tensors.items() for p, t in parts.items() if t is not None}
    t = threading.Thread(target=_write, args=(entry.path, flat, {"key": json.dumps(entry.key, sort_keys=True)}),
                         name="fluxaccel-fp8-cache", daemon=True)
    _writers.append(t)
    t.start()


def wait() -> None:
    """Until every background write is done (tests, tools, shutdown)."""
    while _writers:
        _writers.pop().join()


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors' format, streamed tensor by tensor (no second copy of the weights in memory)."""
    try:
        header, offset = {}, 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for t in tensors.values():
                f.write(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().data)
        os.replace(tmp, path)
        log.info("FluxAccel: saved FP8 weights to %s (%.2f GiB)", path, offset / 1024**3)
        _prune(path)
    except (OSError, KeyError, RuntimeError) as e:
        log.warning("FluxAccel: could not save FP8 weights to %s (%s: %s); the next start quantizes again", path,
                    type(e).__name__, e)


def _prune(keep: Path) -> None:
    """The least recently used files go while the folder holds more than its bound."""
    bound = os.environ.get(ENV_MAX, "64")
    limit = float(bound) * 1024**3
    for tmp in keep.parent.glob(".*.tmp"):  # a write cut short by a process that ended
        if time.time() - tmp.stat().st_mtime > 86400:
            tmp.unlink(missing_ok=True)
    files = sorted((f for f in keep.parent.glob("*.safetensors")), key=lambda f: f.stat().st_mtime)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        if total <= limit or f == keep:
            continue
        total -= f.stat().st_size
        f.unlink(missing_ok=True)
        log.info("FluxAccel: removed the least recently used FP8 weights file %s (folder over %s GiB)", f, bound)
