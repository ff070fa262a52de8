"""The decode-GEMM tuning decisions kept on disk (runtime/ops/tuning_cache.py): what one process measured, the next
reads back instead of timing (and compiling) every candidate kernel again."""
from __future__ import annotations

import json

import torch

from xllm_gen.runtime.layers import fused as FU
from xllm_gen.runtime.layers import linear as LIN
from xllm_gen.runtime.ops import tuning_cache as TC


def test_roundtrip_merge_and_switches(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    k1, k2 = TC.key("gemm", 1, 1024, 2048, torch.bfloat16), TC.key("fused_norm", 4, 4096, 1024, torch.float16)
    assert k1 == "gemm|1|1024|2048|bfloat16"
    TC.save(path, {k1: (2, 512, 4, 1)})
    TC.save(path, {k2: ((8, 512, 4, 1), False)})          # a second writer merges, never drops the first
    assert TC.load(path) == {k1: (2, 512, 4, 1), k2: ((8, 512, 4, 1), False)}
    TC.save(path, {k1: False})
    assert TC.load(path)[k1] is False
    path.write_text("{not json")
    assert TC.load(path) == {}                              # unreadable: measured again, then rewritten
    monkeypatch.setenv("XLLM_TUNING_CACHE", "0")
    assert TC.cache_path() is None
    monkeypatch.setenv("XLLM_TUNING_CACHE", str(path))
    assert TC.cache_path() == path
    monkeypatch.delenv("XLLM_TUNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert TC.cache_path().parent == tmp_path / "xdg" / "xllm_gen" / "tuning"


def test_cached_decisions_skip_measuring(tmp_path, monkeypatch):
    """tune_fused_gemvs takes every decision the cache holds without timing anything; a shape missing from it is
    measured (here: the timer is called, and raises; a failed measurement keeps the plain ops, unsaved)."""
    N, K, dt = 96, 64, torch.bfloat16
    w = torch.zeros(N, K, dtype=dt)
    cached = {TC.key(f"fused_{p}", M, N, K, dt): ((2, 64, 4, 1), M == 1) for p in ("norm", "act") for M in (1, 2)}
    monkeypatch.setattr(FU, "MODE", "")
    monkeypatch.setattr(FU, "FUSED_GEMV_CHOICE", {"norm": {}, "act": {}})

    def no_timing(*a, **k):
        raise AssertionError("measured a decision the cache holds")
    monkeypatch.setattr(LIN, "graph_time_ms", no_timing)
    new: dict = {}
    FU.tune_fused_gemvs({(N, K, dt): [(w, None)]}, [1, 2], (cached, new))
    assert FU.FUSED_GEMV_CHOICE["norm"][(1, N, K, dt)] == ((2, 64, 4, 1), True)
    assert FU.FUSED_GEMV_CHOICE["act"][(2, N, K, dt)] == ((2, 64, 4, 1), False)
    assert new == {}
    calls = []

    def timing(*a, **k):
        calls.append(1)
        raise AssertionError("measured")
    monkeypatch.setattr(LIN, "graph_time_ms", timing)
    FU.tune_fused_gemvs({(N, 2 * K, dt): [(torch.zeros(N, 2 * K, dtype=dt), None)]}, [1], (cached, new))
    assert calls, "a shape missing from the cache was not measured"
    assert FU.FUSED_GEMV_CHOICE["norm"][(1, N, 2 * K, dt)] == (None, False) and new == {}


def test_json_is_plain(tmp_path):
    path = tmp_path / "t.json"
    TC.save(path, {TC.key("gemm", 8, 10, 20, torch.float16): (4, 512, 2, 3)})
    assert json.loads(path.read_text()) == {"gemm|8|10|20|float16": [4, 512, 2, 3]}
