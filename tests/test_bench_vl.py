"""bench/bench_vl.py end to end on the CPU (tiny Qwen3-VL fixture checkpoint, float32): both inputs get numbers
for our engine and transformers, and the report is written. The GPU run is the same script with its defaults."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow            # a benchmark's smoke run (16 s); --runslow
def test_bench_vl_cpu_smoke(tmp_path):
    out = tmp_path / "vl.md"
    cmd = [sys.executable, str(REPO / "bench" / "bench_vl.py"), "--device", "cpu", "--variant", "tiny",
           "--image-size", "64", "--frames", "2", "--frame-size", "64", "--runs", "2", "--warmup", "1",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    R = json.loads(out.with_suffix(".json").read_text())
    assert set(R["rows"]) == {"image", "video"}
    for name, row in R["rows"].items():
        errors = {k: v for k, v in row.items() if k.endswith("_error")}
        assert not errors, f"{name}: {errors}"
        for key in ("xllm_ttft", "hf_ttft", "hf_generate", "xllm_vision", "hf_vision", "xllm_preprocess",
                    "xllm_ttft_host", "xllm_preprocess_host", "hf_ttft_device", "xllm_vision_eager"):
            assert row[key]["median_ms"] > 0, (name, key, row[key])
        # the device-preprocessing arm (on the CPU: device="cpu" given to the processors) equals the host arm
        assert row["arms_same_ids_and_grids"] is True and row["arms_pixel_max_diff"] == 0.0
        assert row["prompt_tokens"] == row["hf_prompt_tokens"] > row["visual_tokens"] > 0
        assert row["grid_thw"] == row["hf_grid_thw"]
    assert not [k for k in R if k.endswith("_error")], R
    md = out.read_text()
    assert "| image |" in md and "| video |" in md
    assert R["xllm_preprocess_device"]["modalities"] == ["images_kwargs", "videos_kwargs"]


@pytest.mark.slow
def test_bench_vl_timeout_writes_partial_report(tmp_path):
    out = tmp_path / "vl.md"
    cmd = [sys.executable, str(REPO / "bench" / "bench_vl.py"), "--device", "cpu", "--variant", "tiny",
           "--image-size", "64", "--frames", "2", "--frame-size", "64", "--runs", "2", "--warmup", "1",
           "--timeout", "2", "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "TIMEOUT" in p.stdout and "--timeout 2 s passed" in json.loads(out.with_suffix(".json").read_text())["timeout"]
