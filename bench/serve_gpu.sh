#!/usr/bin/env bash
# Serving benchmark on a GPU host over HTTP (bench/bench_serve.py against xllm-gen-serve), random bf16 weights
# of Qwen3 shapes (--load-format dummy, config.json from specs/qwen3.yaml variants via bench_decode.write_config):
#   1. Qwen3-0.6B: random prompts, fixed concurrency (16), input 1024, output 128
#   2. Qwen3-0.6B: shared-prefix prompts (896 of 1024 tokens common), prefix caching on, then off
#   3. Qwen3-8B: as 1
#   async: Qwen3-0.6B as 1, with async scheduling off (--no-async-scheduling): the baseline of 1 in the same call
#   modes: Qwen3-0.6B, 64 prompts at concurrency 64, input 1024, output 129: the engine-core process, the engine in
#          the API process (--engine-in-process), 2 API processes, and offline (no HTTP) on the same prompts
#          (issue 23's target: serving >= 0.9x offline req/s, ITL p99 <= 2x p50)
# Each server runs alone; the reports (JSON + the printed table) go to $OUT/serve_*.json and $OUT/serve.log.
#   modes_core: as modes, the default layout (engine-core process, one API process) and offline only
#   usage: OUT=/tmp/out bash bench/serve_gpu.sh [0.6b,async,prefix,8b,modes,modes_core]
set -u
phases=",${1:-0.6b,prefix,8b},"
OUT=${OUT:-/tmp/xllm_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
L=$OUT/serve.log
W=$(mktemp -d)
python - "$W" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from bench_decode import write_config
for name in ("Qwen3-0.6B", "Qwen3-8B"):
    write_config(Path(sys.argv[1]), name)
EOF
port=8311
serve_bench() {   # tag model_dir server-args -- bench-args
  local tag=$1 dir=$2; shift 2
  local sargs=() ; while [ "$1" != "--" ]; do sargs+=("$1"); shift; done; shift
  echo "=== $tag: server ${sargs[*]}; bench $*" | tee -a "$L"
  python -m xllm_gen.runtime.serving.server "$dir" --load-format dummy --dtype bfloat16 --port $port --max-model-len 2048 --log-level warning \
    "${sargs[@]}" >> "$L" 2>&1 &
  local pid=$!
  python - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(480):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        break
    except Exception:
        time.sleep(0.25)
PY
  timeout 240 python bench/bench_serve.py --base-url "http://127.0.0.1:$port" --json "$OUT/serve_$tag.json" "$@" 2>&1 | tee -a "$L"
  kill -TERM $pid; wait $pid 2>/dev/null
  port=$((port + 1))
}
common="--num-prompts 64 --request-rate inf --max-concurrency 16 --input-len 1024 --output-len 128"
[[ $phases == *,0.6b,* ]] && serve_bench 0.6b_random "$W/Qwen3-0.6B" -- $common
if [[ $phases == *,prefix,* ]]; then
  serve_bench 0.6b_prefix_on "$W/Qwen3-0.6B" -- $common --shared-prefix-len 896
  serve_bench 0.6b_prefix_off "$W/Qwen3-0.6B" --no-enable-prefix-caching -- $common --shared-prefix-len 896
fi
[[ $phases == *,async,* ]] && serve_bench 0.6b_random_sync "$W/Qwen3-0.6B" --no-async-scheduling -- $common
[[ $phases == *,8b,* ]] && serve_bench 8b_random "$W/Qwen3-8B" -- $common
if [[ $phases == *,modes,* ]]; then
  m64="--num-prompts 64 --max-concurrency 64 --input-len 1024 --output-len 129"
  sa="--load-format dummy --dtype bfloat16 --max-model-len 2048"
  echo "=== modes: core, in-process, offline; $m64" | tee -a "$L"
  timeout 900 python bench/bench_serve.py --serve "$W/Qwen3-0.6B" --modes core,in-process,offline --serve-args "$sa" \
    $m64 --json "$OUT/serve_modes.json" 2>&1 | tee -a "$L"
  timeout 600 python bench/bench_serve.py --serve "$W/Qwen3-0.6B" --modes core --serve-args "$sa --api-server-count 2" \
    $m64 --json "$OUT/serve_modes_2api.json" 2>&1 | tee -a "$L"
fi
if [[ $phases == *,modes_core,* ]]; then      # the default layout against offline only (a short re-measure)
  m64="--num-prompts 64 --max-concurrency 64 --input-len 1024 --output-len 129"
  sa="--load-format dummy --dtype bfloat16 --max-model-len 2048"
  timeout 600 python bench/bench_serve.py --serve "$W/Qwen3-0.6B" --modes core,offline --serve-args "$sa" \
    $m64 --json "$OUT/serve_modes_core.json" 2>&1 | tee -a "$L"
fi
echo "=== done" | tee -a "$L"
