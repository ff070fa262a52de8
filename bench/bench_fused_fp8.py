"""Fused decode prologues over float8 weights (runtime/ops/fused_gemv_fp8.py) at Qwen3-8B shapes, one H100 / H200:
the fused GEMV (norm_gemv for qkv / gate_up, act_gemv for down) in a sweep of launch configs against the plain pair
(the norm / silu-and-mul kernel, ending in the input's fp8 round trip where the layer quantizes its input, then the
float8 skinny GEMM in its best candidate), per weight form: per-channel scales with bf16 input ("ch"), 128-column
scales with inputs quantized per token and 128 columns ("blk_q"). Each timing replays a CUDA graph over enough
distinct weights to stream ~96 MB from HBM (linear.graph_time_ms / timing_sequence), per call.

    python bench/bench_fused_fp8.py [--rows 1,4] [--top 6] [--out bench/results/h100_fused_fp8.md]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPES = {"qkv": (6144, 4096, "norm"), "gate_up": (24576, 4096, "norm"), "down": (4096, 12288, "act")}
# (BLOCK_N, BLOCK_K, warps, stages[, VEC]): VEC (default 16 float8 elements) 4 / 8: more weight rows a thread for
# each x element it computes
GRID = [(2, 1024, 2, 1), (4, 1024, 2, 1), (4, 512, 2, 1), (4, 1024, 4, 1)] + [
    (bn, 32 * vec * w * slots, w, 1, vec) for vec, bn, w, slots in itertools.product((4, 8), (8, 16), (2, 4), (1, 2))
    if bn * vec * slots <= 64]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.layers.linear import graph_time_ms, timing_sequence
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import norm_act_kernels as NK
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops.skinny_fma import skinny_gemm_candidates
    lines = [f"# fused fp8 prologue GEMVs, {torch.cuda.get_device_name()}", "",
             "| shape | form | M | plain us (prologue + best GEMM) | GEMM alone us | best fused us | speedup | "
             "best fused configs (us) |", "|---|---|---|---|---|---|---|---|"]
    dt = torch.bfloat16
    for name, (N, K, pro) in SHAPES.items():
        for form in ("ch", "blk_q"):
            bk_s, group = (K, 0) if form == "ch" else (128, 128)
            one = []
            for _ in range(4):
                w8 = (torch.randn(N, K, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                one.append((w8, torch.rand(N, K // bk_s, device="cuda") * 1e-3 + 1e-4))
            seq = timing_sequence(one, N, K)
            block = (1, bk_s)
            for M in (int(r) for r in args.rows.split(",")):
                x, r = (torch.randn(M, K, device="cuda", dtype=dt) for _ in range(2))
                g = torch.randn(K, device="cuda", dtype=dt)
                gu = torch.randn(M, 2 * K, device="cuda", dtype=dt)
                quant = (group, None) if group else None

                def prologue():
                    if pro == "norm":
                        return NK.fused_add_rms_norm(x, r, g, 1e-6, quant=quant)[0] if quant else \
                            ops.fused_add_rms_norm(x, r, g, 1e-6)[0]
                    return NK.silu_and_mul(gu, quant=quant) if quant else ops.silu_and_mul(gu)
                h = prologue()
                gemms = [("fma", c) for c in skinny_gemm_candidates(M, N, K, 1)] + [("mma", None)]
                t_gemm = min(graph_time_ms(lambda: [Q.fp8_gemm(h, w, s, block, None, c, k) for w, s in seq])
                             / len(seq) for k, c in gemms)
                t_plain = min(graph_time_ms(lambda: [Q.fp8_gemm(prologue(), w, s, block, None, c, k) for w, s in seq])
                              / len(seq) for k, c in gemms)
                timed = []
                for cfg in GRID:
                    if group and cfg[1] % group:
                        continue
                    kw = dict(config=cfg, block=block, group=group)
                    if pro == "norm":
                        def fn():
                            return [FG.norm_gemv(x, r, g, 1e-6, 0.0, w, None, scale=s, **kw) for w, s in seq]
                    else:
                        def fn():
                            return [FG.act_gemv(gu, w, None, "silu", scale=s, **kw) for w, s in seq]
                    try:
                        timed.append((graph_time_ms(fn) / len(seq) * 1e3, cfg))
                    except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
                        print(f"{name} {form} M{M} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
                timed.sort()
                best = ", ".join(f"{c} {t:.2f}" for t, c in timed[:args.top])
                row = (f"| {name} | {form} | {M} | {t_plain * 1e3:.2f} | {t_gemm * 1e3:.2f} | {timed[0][0]:.2f} | "
                       f"{t_plain * 1e3 / timed[0][0]:.2f}x | {best} |")
                print(row, flush=True)
                lines.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
