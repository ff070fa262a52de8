"""Starts `xllm-gen-serve` as a real process on a free local port (for tests/test_serving*.py)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# The server's two layouts: the engine core in its own process (the default) and the engine in a thread of the
# API process (--engine-in-process). Server fixtures run over both; the second arm is slow-marked (the default
# CPU run covers it with tests/test_serving_core.py's fast in-process test).
ENGINE_MODES = ["core", pytest.param("in-process", marks=pytest.mark.slow)]


def mode_args(mode: str) -> tuple:
    return ("--engine-in-process",) if mode == "in-process" else ()


def descendants(pid: int) -> list:
    """The live processes under `pid` (children, grandchildren, ...)."""
    import psutil

    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"xllm-serve-{self.port}.log"
        cmd = [sys.executable, "-m", "xllm_gen.runtime.serving.server", *([str(model)] if model else []),
               "--port", str(self.port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *args]
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout} s:\n{self.log.read_text()}")

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.labels.get("le") and not s.name.endswith("_created"):
                    key = s.name + ("" if set(s.labels) <= {"model_name"} else
                                    str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
                    out[key] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Metrics once nothing runs or waits and no KV block is in use (fails after timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["xllm:num_requests_running"], m["xllm:num_requests_waiting"], m["xllm:kv_cache_usage_perc"]) \
                    == (0, 0, 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {m}")
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode
