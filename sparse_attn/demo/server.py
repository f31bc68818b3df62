"""A small harness around ``sparse-attn serve``: start, wait, query, stop.

Used by ``sparse-attn demo`` and the HTTP engine tests. Stdlib only (no
``requests``/``openai``), so it works in any environment that has vLLM::

    with ServeProcess(ckpt, log_path="serve.log", max_model_len=4096) as server:
        server.wait_ready(timeout=300)
        out = server.complete("Once upon a time", max_tokens=8)
        outs = server.complete_many([{"prompt": p, "max_tokens": 16} for p in prompts])
        stats = server.stats()            # one dict per worker (POST /collective_rpc)
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

from compat.launch import SERVER_RPC_ROUTE
from sparse_attn.plugin import STATS_RPC

__all__ = ["ServerError", "ServeProcess", "free_port", "log_tail"]

LOOPBACK = "127.0.0.1"
STATS_METHOD = STATS_RPC


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

    ``vllm_args`` are appended to the command. ``kv_cache_gib`` sets
    ``VLLM_CPU_KVCACHE_SPACE`` unless the environment already has it or
    ``--kv-cache-memory-bytes`` is passed. ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``
    (needed for ``/collective_rpc`` and so for :meth:`stats`).
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
    ):
        if host not in (LOOPBACK, "localhost", "::1"):
            raise ValueError(f"the harness serves on loopback only, got host {host!r}")
        self.checkpoint = str(checkpoint)
        self.log_path = Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        self.model = served_model_name or self.checkpoint
        args = ["--host", host, "--port", str(self.port), "--dtype", dtype, "--enforce-eager"]
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        if served_model_name:
            args += ["--served-model-name", served_model_name]
        self.command = [sys.executable, "-m", "sparse_attn", "serve", self.checkpoint, *args, *vllm_args]
        self.env = dict(os.environ if env is None else env)
        if "VLLM_CPU_KVCACHE_SPACE" not in self.env and not any(a.startswith("--kv-cache-memory") for a in vllm_args):
            self.env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if dev_mode:
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
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
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
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
        """The plugin's per-worker counters (``sparse_attn_stats`` through ``POST /collective_rpc``,
        needs ``dev_mode``); integers, sum them across workers before taking ratios."""
        body: dict[str, Any] = {"method": STATS_METHOD}
        if reset:
            body["kwargs"] = {"reset": True}
        out = self.request("POST", SERVER_RPC_ROUTE, body, timeout=60)
        return list((out or {}).get("results", []))


def phase_totals(stats: Sequence[Mapping[str, Any]], phase: str) -> dict[str, int]:
    """Sum one phase's integer counters over workers."""
    keys = ("skipped", "visited", "launches", "native_launches", "dense_launches")
    return {k: sum(int(s["phases"][phase][k]) for s in stats) for k in keys}
