#!/usr/bin/env bash
# One call on an offline GPU host: install the carried wheels (.whl, see ../shared/gpu/wheels.sh), restore
# saved FlashInfer kernels (.fi_cache, with reuse-kernels.sh inside), then run the requested phases, each
# under its own time limit so that one slow phase leaves the others' results:
#   tests       pytest -m gpu $TEST_FILES (default tests/gpu/test_gpu_graphs.py; JSON lines in $OUT/test_report.jsonl)
#   sweep       bench: copy bandwidth + Qwen3-0.6B sweep (eager, graph, graph-fast)
#   8b          bench: Qwen3-8B at batch 1, 16, 64
#   profile     bench: where a graph decode step goes (batch 1 and 100)
#   throughput  bench: 256 requests, random lengths 100-1024
#   hf          bench: transformers baseline (static cache + torch.compile)
#   moe         bench: Qwen3-30B-A3B shapes, bench/bench_moe.py ($OUT/h200_moe.md; MOE_ARGS adds arguments)
#   vl          bench: Qwen3-VL-8B shapes, bench/bench_vl.py --profile ($OUT/h200_vl.md; VL_ARGS adds arguments)
#   serve       bench/serve_gpu.sh over HTTP ($SERVE_PHASES, default 0.6b,prefix,8b; modes: the process layouts;
#               needs .whl_serve wheels, pyzmq among them: the image has none)
# The bench phases add to one table, $OUT/h200.md (+ .json). Everything is logged to $OUT/log.
#   usage: bash bench/gpu_run.sh tests,sweep,8b,throughput,hf
set -u
phases=",${1:-tests,sweep,8b,throughput,hf},"
OUT=${OUT:-/tmp/xllm_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log") 2>&1
t0=$(date +%s)
stamp() { echo "=== $(( $(date +%s) - t0 )) s: $*"; }
if ! python -c "import flashinfer" 2>/dev/null; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed (PYTHONPATH has the repo)"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
had_kernels=0
saved=.fi_cache
if [ -f .fi_cache/fi_kernels.tgz ]; then   # ./NAME/NAME.so entries, as saved below
  mkdir -p /tmp/fik && tar xzf .fi_cache/fi_kernels.tgz -C /tmp/fik && saved=/tmp/fik
fi
if compgen -G "$saved/*/*.so" >/dev/null; then
  bash .fi_cache/reuse-kernels.sh "$saved" /tmp/site >/dev/null && had_kernels=1
fi
# Triton's compiled kernels (the decode-GEMM tuning at engine start compiles dozens of launch configs: minutes on a
# fresh host) restored from a previous call's $OUT/triton_cache.tgz, carried as .fi_cache/triton_cache.tgz
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .fi_cache/triton_cache.tgz ] && tar xzf .fi_cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"
stamp "setup done (saved kernels restored: $had_kernels)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python - <<'EOF'
import torch, triton, transformers
try:
    import flashinfer; fv = flashinfer.__version__
except Exception as e:
    fv = f"import failed: {e}"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "flashinfer", fv)
EOF

if [[ $phases == *,tests,* ]]; then
  stamp "tests"
  XLLM_TEST_REPORT=$OUT/test_report.jsonl timeout ${T_TESTS:-300} python -m pytest -q -rs -m gpu -s \
    ${TEST_FILES:-tests/gpu/test_gpu_graphs.py} -p no:cacheprovider 2>&1 | grep -v "^Capturing\|it/s\]$" | tail -n 200
fi
# APPEND_RESULTS=1: start from the committed results (bench/results/h200.json) and add to them
[ "${APPEND_RESULTS:-0}" = 1 ] && [ -f bench/results/h200.json ] && cp bench/results/h200.json "$OUT/h200.json"
bench() { timeout "$1" python bench/bench_decode.py --out "$OUT/h200.md" --append --sections "$2" "${@:3}"; }
[[ $phases == *,sweep,* ]] && { stamp "sweep"; bench ${T_SWEEP:-240} ${SWEEP_SECTIONS:-floor,sweep} ${SWEEP_ARGS:-}; }
[[ $phases == *,profile,* ]] && { stamp "profile"; bench ${T_PROFILE:-90} profile; }
[[ $phases == *,8b,* ]] && { stamp "8b"; bench ${T_8B:-150} 8b ${B8_ARGS:-}; }
[[ $phases == *,throughput,* ]] && { stamp "throughput"; bench ${T_TP:-90} throughput; }
[[ $phases == *,hf,* ]] && { stamp "hf"; bench ${T_HF:-200} hf; }
[[ $phases == *,vl,* ]] && { stamp "vl"; timeout ${T_VL:-240} python bench/bench_vl.py --profile --out "$OUT/h200_vl.md" ${VL_ARGS:-}; }
[[ $phases == *,moe,* ]] && { stamp "moe"; timeout ${T_MOE:-180} python bench/bench_moe.py --out "$OUT/h200_moe.md" ${MOE_ARGS:-}; }
if [[ $phases == *,serve,* ]]; then
  stamp "serve"
  python -m pip install -q --no-index --find-links .whl_serve fastapi uvicorn prometheus_client httpx pyzmq
  timeout ${T_SERVE:-420} bash bench/serve_gpu.sh ${SERVE_PHASES:-0.6b,prefix,8b}
fi
# kernels built in this run (not among the restored ones) come back as one tar to merge into .fi_cache
if compgen -G "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/*/*/cached_ops/*/*.so" >/dev/null; then
  stamp "saving newly built FlashInfer kernels"
  (cd "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops && tar czf "$OUT/fi_new_kernels.tgz" $(find . -name "*.so"))
  ls -la "$OUT/fi_new_kernels.tgz"
fi
# everything Triton built, for the next call (SAVE_TRITON_CACHE=1: tens of MB, may exceed what a call returns)
if [ "${SAVE_TRITON_CACHE:-0}" = 1 ] && [ -n "$(ls -A "$TRITON_CACHE_DIR" 2>/dev/null)" ]; then
  (cd "$TRITON_CACHE_DIR" && tar czf "$OUT/triton_cache.tgz" .)
  ls -la "$OUT/triton_cache.tgz"
fi
stamp "done"
