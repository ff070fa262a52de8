"""bench/bench_spec.py's CPU smoke run on a tiny checkpoint: every arm runs, the table and JSON are written, and the
arms mean what they say (draft = target accepts everything, the shuffled draft almost nothing)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_spec_cpu_smoke(qwen3_tied, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_spec
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = tmp_path / "spec.md"
    rc = bench_spec.main(["--device", "cpu", "--dtype", "float32", "--model-dir", str(qwen3_tied),
                          "--batch-sizes", "1,3", "--in-len", "8", "--out-len", "12", "--runs", "1",
                          "--num-kv-blocks", "256", "-k", "3", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    for arm in ("nospec", "draft=target", "draft-shuffled", "ngram"):
        assert f"| {arm} |" in text
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["nospec"]["1"]["acceptance"] is None
    assert all(r["acceptance"] == 1.0 for r in res["draft=target"].values())
    assert all(r["acceptance"] < 0.1 for r in res["draft-shuffled"].values())
