"""Engine start-up time on a GPU, per architecture: the tiny checkpoint tests/gpu/test_gpu_specs.py builds, then
LLM(...) in bf16 with decode graphs, timed, with the runner's INFO log (weights, decode-GEMM tuning, graph capture).
Run it twice in one call to see what the decode-GEMM tuning cache (runtime/ops/tuning_cache.py) saves.

    python bench/startup_probe.py Qwen3ForCausalLM AfmoeForCausalLM Qwen3ForCausalLM
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "gpu")]


def main(archs: list[str]) -> int:
    from test_gpu_specs import _checkpoint

    from xllm_gen import LLM
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
    for arch in archs:
        t0 = time.time()
        ckpt = _checkpoint(arch, Path(tempfile.mkdtemp()) / "c")
        t1 = time.time()
        llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512, max_model_len=512)
        t2 = time.time()
        print(f"STARTUP {arch}: checkpoint {t1 - t0:.1f} s, LLM() {t2 - t1:.1f} s", flush=True)
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["Qwen3ForCausalLM"]))
