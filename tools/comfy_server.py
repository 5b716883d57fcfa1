"""A real ComfyUI server on 127.0.0.1, driven over its HTTP and websocket API.

Used by the headless benchmark command and by the end-to-end tests (the same code path a user's
/prompt client takes). HTTP uses the standard library; the websocket uses aiohttp (a ComfyUI dependency).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable

log = logging.getLogger("fluxaccel.server")


class PromptRejected(RuntimeError):
    """ComfyUI refused a prompt at validation (HTTP 400); .body holds its JSON answer."""

    def __init__(self, body: dict):
        super().__init__(json.dumps(body)[:2000])
        self.body = body


class PromptFailed(RuntimeError):
    """A prompt was accepted but its execution raised; .messages holds ComfyUI's status messages."""

    def __init__(self, messages: list, exception_message: str):
        super().__init__(exception_message)
        self.messages = messages
        self.exception_message = exception_message


CPU_FP8_NODES = Path(__file__).resolve().parent / "cpu_fp8_node"
MEMORY_MODEL_NODES = Path(__file__).resolve().parent / "memory_model_node"
# CPU servers (tests, the CPU demo): ComfyUI runs FLUX in float32 from bf16 weights there, casting every Linear's
# weight per call (up to 150 MB each); glibc hands each such block back to the OS (mmap/munmap) and page-faults it in
# again on the next forward. Keeping freed memory in the server's heap makes a forward of the 3072-wide e2e model
# about twice as fast. Not for the test processes themselves:
# their heap would then keep its peak (7 GB each seen in CI) for the whole run. A variable already set wins.
CPU_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


# FluxAccel's log lines for a compile in a separate process (core/compile/separate.py): started, and ended
SEPARATE_START = re.compile(r"compiling .+ in a separate process \(pid")
SEPARATE_END = re.compile(r"compiled in a separate process in ([0-9.]+) s \(\d+ model call|"
                          r"the separate-process compile of .+ failed after ([0-9.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress_text(frame: bytes) -> dict | None:
    """ComfyUI's binary progress-text message (event 3: node id length, node id, UTF-8 text) as {node, text}."""
    import struct

    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != 3:
        return None
    n = struct.unpack(">I", frame[4:8])[0]
    return {"node": frame[8:8 + n].decode(), "text": frame[8 + n:].decode(errors="replace")}


class ComfyServer:
    def __init__(self, comfy_dir: Path, workdir: Path, models_dir: Path, extra_args: tuple[str, ...] = (),
                 env: dict | None = None, port: int | None = None, cpu_fp8: bool = False,
                 memory_model: bool = False, timestamps: bool = False):
        """cpu_fp8: the server also loads tools/cpu_fp8_node (lifts torchao's FP8 gate for a CPU test or demo);
        memory_model: tools/memory_model_node (random-weight FLUX models built in host memory, no file);
        timestamps: each line of the log starts with the seconds since the server started (ComfyUI's own lines carry
        none): where a first prompt's time goes. The lines then reach the file through a thread of this process,
        a moment after ComfyUI prints them, so read the log once the server stopped."""
        self.timestamps = timestamps
        self.comfy_dir, self.workdir, self.models_dir = Path(comfy_dir), Path(workdir), Path(models_dir)
        self.cpu_fp8, self.memory_model = cpu_fp8, memory_model
        self.extra_args, self.env = list(extra_args), env
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "comfyui.log"

    @property
    def output_dir(self) -> Path:
        return self.workdir / "output"

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, timeout: float = 300) -> "ComfyServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("output", "input", "temp", "user"):
            (self.workdir / sub).mkdir(exist_ok=True)
        paths = self.workdir / "extra_model_paths.yaml"
        text = f"fluxaccel:\n  base_path: {self.models_dir}\n  diffusion_models: diffusion_models\n  loras: loras\n"
        tool_nodes = [d for d, on in ((CPU_FP8_NODES, self.cpu_fp8), (MEMORY_MODEL_NODES, self.memory_model)) if on]
        if tool_nodes:  # one folder per line (ComfyUI splits the value on newlines)
            text += "  custom_nodes: |\n" + "".join(f"    {d}\n" for d in tool_nodes)
        paths.write_text(text)
        cmd = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(self.port),
               "--output-directory", str(self.workdir / "output"), "--input-directory", str(self.workdir / "input"),
               "--temp-directory", str(self.workdir / "temp"), "--user-directory", str(self.workdir / "user"),
               "--extra-model-paths-config", str(paths), "--disable-auto-launch", *self._optional_args(),
               *self.extra_args]
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        if "--cpu" in self.extra_args:
            for k, v in CPU_MALLOC.items():
                env.setdefault(k, v)
        log.info("starting ComfyUI: %s", " ".join(cmd))
        self._logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=subprocess.PIPE if self.timestamps else self._logf,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if self.timestamps:
            self._pump = threading.Thread(target=self._stamp_lines, args=(time.time(),), name="comfyui-log", daemon=True)
            self._pump.start()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} during start:\n{self.log_tail()}")
            try:
                self.get("/system_stats")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout}s:\n{self.log_tail()}")

    def _optional_args(self) -> list[str]:
        """Flags passed only where this ComfyUI has them (read off its cli_args.py):
        - its sqlite database in this server's user folder: its default (ComfyUI/user/comfyui.db) is in a folder that
          only exists once ComfyUI ran with its own user folder, else its start logs an [ERROR] (0.3.4x and later);
        - its cloud API nodes left out: a server started here runs local workflows, and importing those modules is a
          large part of every start; also keeps its frontend off the internet."""
        cli = self.comfy_dir / "comfy" / "cli_args.py"
        text = cli.read_text(errors="replace") if cli.is_file() else ""
        args = []
        if "--database-url" in text:
            args += ["--database-url", f"sqlite:///{self.workdir / 'user' / 'comfyui.db'}"]
        if "--disable-api-nodes" in text:
            args.append("--disable-api-nodes")
        return args

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_pump", None):
            self._pump.join(10)
        if getattr(self, "_logf", None):
            self._logf.close()

    def _stamp_lines(self, t0: float) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self._logf.write(b"%9.3f " % (time.time() - t0) + line)
            self._logf.flush()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def separate_compiles(self, since: int = 0, timeout: float = 1800) -> list[dict]:
        """Wait until every compile the server started in a separate process since log offset `since` (its log says
        so) has ended; what the log says of each, in order: {"separate_compile": "ready" | "failed",
        "separate_compile_s": seconds, "waited_after_first_prompt_s": how long this waited}."""
        def text() -> str:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")

        t0 = time.monotonic()
        while True:
            said = text()
            started, ended = len(SEPARATE_START.findall(said)), list(SEPARATE_END.finditer(said))
            if len(ended) >= started:
                break
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{started - len(ended)} separate-process compile(s) not finished after "
                                   f"{timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        waited = round(time.monotonic() - t0, 1)
        return [{"separate_compile": "failed" if m.group(2) else "ready",
                 "separate_compile_s": float(m.group(2) or m.group(1)), "waited_after_first_prompt_s": waited}
                for m in ended]

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- HTTP --------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body=None, timeout: float = 60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return json.loads(raw) if raw and r.headers.get_content_type() == "application/json" else raw

    def get(self, path: str, timeout: float = 60):
        return self._request("GET", path, timeout=timeout)

    def post(self, path: str, body=None, timeout: float = 60):
        return self._request("POST", path, body if body is not None else {}, timeout=timeout)

    def queue(self, prompt: dict) -> str:
        try:
            res = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise PromptRejected(body) from None
        return res["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        return self.get(f"/history/{prompt_id}").get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 1800, poll: float = 0.2) -> dict:
        """Block until the prompt has a /history entry; raise PromptFailed if it ended in an error."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.history(prompt_id)
            if h is not None and h.get("status", {}).get("completed") is not None:
                return self._checked(h)
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(poll)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout}s")

    @staticmethod
    def _checked(h: dict) -> dict:
        st = h["status"]
        if st.get("status_str") == "error":
            msgs = st.get("messages", [])
            err = next((m[1] for m in msgs if m[0] == "execution_error"), {})
            raise PromptFailed(msgs, err.get("exception_message", json.dumps(msgs)[:2000]))
        return h

    def run(self, prompt: dict, timeout: float = 1800) -> dict:
        return self.wait(self.queue(prompt), timeout=timeout)

    @staticmethod
    def cached_nodes(hist: dict) -> list[str]:
        """Node ids ComfyUI served from its node cache in this prompt (not executed)."""
        return next((m[1]["nodes"] for m in hist["status"]["messages"] if m[0] == "execution_cached"), [])

    def saved_latent(self, hist: dict, node: str):
        """The latent a SaveLatent node wrote in this prompt, read back from the output folder."""
        from safetensors.torch import load_file

        f = hist["outputs"][node]["latents"][0]
        return load_file(str(self.output_dir / f["subfolder"] / f["filename"]))["latent_tensor"]

    def memory_bytes(self) -> dict[str, int]:
        """The server process's resident memory now (VmRSS: RssAnon + RssFile + RssShmem) and its high-water mark
        (VmHWM), from /proc (Linux)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:"))}

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux)."""
        return self.memory_bytes()["VmRSS"]

    def free(self, unload_models: bool = True, free_memory: bool = True, settle: bool = True) -> None:
        """POST /free. ComfyUI's prompt worker reads these flags only after it has executed the next queue item, so
        an idle server would run the next prompt before freeing anything: with settle, a tiny prompt goes first
        and the flags are in effect (models unloaded, caches reset) for whatever is queued after it."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory})
        if settle:
            self.run({"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
                      "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0],
                                                                   "filename_prefix": "fluxaccel-free-settle"}}})

    def interrupt(self) -> None:
        self.post("/interrupt", {})

    # -- websocket ---------------------------------------------------------------------------------------
    def run_following(self, prompt: dict, on_event: Callable[[str, dict], None], timeout: float = 3600) -> dict:
        """Queue a prompt and pass every websocket event for it to on_event(type, data) until it ends."""
        return asyncio.run(self._follow(prompt, on_event, timeout))

    async def _follow(self, prompt: dict, on_event, timeout: float) -> dict:
        import aiohttp

        ws_url = f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}"
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url, heartbeat=30, max_msg_size=0) as ws:
                prompt_id = await asyncio.to_thread(self.queue, prompt)
                deadline = time.time() + timeout
                while time.time() < deadline:
                    try:
                        msg = await ws.receive(timeout=5)
                    except asyncio.TimeoutError:
                        if self.proc and self.proc.poll() is not None:
                            raise RuntimeError(f"ComfyUI died:\n{self.log_tail()}")
                        continue
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        text = _progress_text(msg.data)
                        if text is not None:
                            on_event("progress_text", text)
                        continue  # otherwise a preview image
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                            break
                        continue
                    ev = json.loads(msg.data)
                    data = ev.get("data", {})
                    if data.get("prompt_id") not in (None, prompt_id):
                        continue
                    on_event(ev["type"], data)
                    if ev["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                        break
                    if ev["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                        break
        return await asyncio.to_thread(self.wait, prompt_id, 120)
