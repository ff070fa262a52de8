"""Decode-GEMM tuning decisions kept on disk between processes.

An engine on CUDA times, per (rows, N, K, dtype) of its decode GEMMs, cuBLAS against the Triton skinny GEMM and the
fused-prologue GEMVs in several launch configs (layers/linear.py tune_decode_gemms, layers/fused.py
tune_fused_gemvs). On a fresh host that compiles dozens of Triton kernels: measured on an H200, 30 s of a 40 s
start for a tiny model. The decisions depend only on the GPU, the torch / Triton builds and the shape, so they are
written here once and read back by every later start (only the chosen kernels are then compiled).

File: $XLLM_TUNING_CACHE (a path), else ~/.cache/xllm_gen/tuning/<gpu>-torch<v>-triton<v>.json;
XLLM_TUNING_CACHE=0 disables it (every start measures). Entries: "kind|rows|N|K|dtype" -> a launch config (list
of ints), true (the launch table's config), false (the plain path), or for the fused GEMVs [config, faster].
Written atomically (several TP ranks may tune at once); an unreadable file is ignored and rewritten.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("xllm_gen")


def cache_path(device: Optional[torch.device] = None) -> Optional[Path]:
    """Where this process's decisions live (None: disabled)."""
    setting = os.environ.get("XLLM_TUNING_CACHE", "").strip()
    if setting == "0":
        return None
    if setting:
        return Path(setting).expanduser()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{gpu}-torch{torch.__version__}-triton{triton_version}")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xllm_gen" / "tuning" / f"{name}.json"


def key(kind: str, rows: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{kind}|{rows}|{n}|{k}|{str(dtype).removeprefix('torch.')}"


def _decode(value):
    """JSON -> the in-memory form: lists become tuples (launch configs are tuples), recursively."""
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def load(path: Optional[Path]) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {k: _decode(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        logger.warning("decode-GEMM tuning cache %s unreadable (%s): measuring again", path, e)
        return {}


def save(path: Optional[Path], new: dict) -> None:
    """Merge `new` into the file (re-read first: another process may have written meanwhile)."""
    if path is None or not new:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**load(path), **new}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:               # a read-only home: tuning still works, it is only not kept
        logger.warning("decode-GEMM tuning cache %s not written (%s)", path, e)
