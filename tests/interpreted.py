"""Triton kernels checked on CPU under TRITON_INTERPRET=1: the variable must be set before triton is imported, so a
test module runs its own `_checks()` in a subprocess (`python MODULE --interpret`, which prints "RESULT <json>") and
its tests read the returned dict."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(module_file: str, timeout: float = 600, **env) -> dict:
    """The dict `module_file`'s `--interpret` run printed; `env`: extra environment variables."""
    p = subprocess.run([sys.executable, os.path.abspath(module_file), "--interpret"],
                       env=dict(os.environ, TRITON_INTERPRET="1", **env), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
