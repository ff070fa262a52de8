"""Decode GEMMs alone: cuBLAS (F.linear) against the Triton skinny GEMMs (runtime/ops; the engine picks per shape)
on the weight shapes of Qwen3-0.6B and Qwen3-8B layers, bf16: the FMA kernel for M <= 8 rows (its launch table's
config), the split-K tensor-core kernel for 9..64 rows (the best of its tuning candidates, as the engine's tuning
picks). Each timing replays a CUDA graph of 20 calls over 20 different weights (so no call finds its weight in L2),
median of 20 replays; GB/s counts the weight bytes read.

    python bench/bench_gemv.py [--out bench/results/h200_gemv.md] [--rows 1,2,4,8,16,32,64] [--sweep-configs]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHAPES = {   # name: (N, K) of y = x W^T
    "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
}


def sweep_configs(T, x, ws, graph_time_ms, calls):
    """[(config, us)] of the skinny GEMM over a grid of launch configs (those that fit K)."""
    K = x.shape[1]
    out = []
    for bn in (2, 4, 8, 16):
        for bk in (256, 512, 1024):
            if bk > max(256, K):
                continue
            for warps in (2, 4, 8):
                for stages in (1, 3):
                    cfg = (bn, bk, warps, stages)
                    t = graph_time_ms(lambda: [T.skinny_gemm(x, w, config=cfg) for w in ws], reps=10) / calls
                    out.append((cfg, round(t * 1e3, 2)))
    return out


def sweep_mma_configs(T, x, ws, graph_time_ms, calls):
    """[(config, us)] of the tensor-core skinny GEMM over launch configs (BLOCK_N, BLOCK_K, stages, programs)."""
    M, K = x.shape
    N = ws[0].shape[0]
    out, seen = [], set()
    for bn in (32, 64, 128):
        for bk in (128, 256):
            for stages in (3, 5):
                for programs in (132, 264, 528):
                    cfg = T.skinny_mma_config(M, N, K, bn, bk, 8 if bn == 128 else 4, stages, programs)
                    if cfg in seen:
                        continue
                    seen.add(cfg)
                    t = graph_time_ms(lambda: [T.skinny_gemm(x, w, config=cfg) for w in ws], reps=10) / calls
                    out.append((cfg, round(t * 1e3, 2)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_gemv.md"))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES to run (default all)")
    ap.add_argument("--sweep-configs", action="store_true",
                    help="also time the skinny GEMM over launch configs (BLOCK_N, BLOCK_K, warps, stages) per shape "
                         "and rows, against the table's (JSON lines; the best five per shape in the report)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    from xllm_gen.runtime.layers.linear import graph_time_ms
    from xllm_gen.runtime.ops import triton_kernels as T
    torch.manual_seed(0)
    calls = 20
    rows = [int(m) for m in args.rows.split(",")]
    res = []
    picked = [n.strip() for n in args.shapes.split(",") if n.strip()]
    for name, (N, K) in SHAPES.items():
        if picked and name not in picked:
            continue
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cublas = graph_time_ms(lambda: [F.linear(x, w) for w in ws], reps=20) / calls
            cands = [None] if M <= T.SKINNY_MAX_M else T.skinny_mma_candidates(M, N, K)
            t_triton, cfg = min((graph_time_ms(lambda: [T.skinny_gemm(x, w, config=c) for w in ws], reps=20) / calls,
                                 c) for c in cands)
            err = (T.skinny_gemm(x, ws[0], config=cfg).float() - F.linear(x, ws[0]).float()).abs().max().item()
            gb = N * K * 2 / 1e9
            res.append(dict(shape=name, N=N, K=K, M=M, cublas_ms=t_cublas, triton_ms=t_triton,
                            cublas_gbs=gb / t_cublas * 1e3, triton_gbs=gb / t_triton * 1e3, max_abs_diff=err,
                            config=cfg))
            print(json.dumps(res[-1]), flush=True)
            if args.sweep_configs:
                sweep = sweep_configs if M <= T.SKINNY_MAX_M else sweep_mma_configs
                res[-1]["configs"] = sweep(T, x, ws, graph_time_ms, calls)
                best = sorted(res[-1]["configs"], key=lambda c: c[1])[:5]
                print(json.dumps(dict(shape=name, M=M, picked=cfg, best=best)), flush=True)
    L = ["# Decode GEMMs: cuBLAS vs the Triton skinny GEMM (bf16)\n",
         f"command: `python bench/bench_gemv.py {' '.join(argv or sys.argv[1:])}`\n",
         f"torch {torch.__version__}, {torch.cuda.get_device_name()}; CUDA graph of {calls} calls over {calls} "
         "weights, median of 20 replays; GB/s of weight bytes\n",
         "| shape | N | K | M | cuBLAS us | Triton us | cuBLAS GB/s | Triton GB/s | Triton / cuBLAS time | config |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        L.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {1e3 * r['cublas_ms']:.1f} | "
                 f"{1e3 * r['triton_ms']:.1f} | {r['cublas_gbs']:.0f} | {r['triton_gbs']:.0f} | "
                 f"{r['triton_ms'] / r['cublas_ms']:.2f} | {r['config'] or 'table'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
