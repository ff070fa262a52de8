"""Prefill GEMMs of a float8 (128 x 128 block) layer at Qwen3-8B shapes, one call, M = 512 .. 8192 rows, bf16 in/out:

- bf16:      F.linear on the bf16 weight (cuBLAS): the baseline;
- dequant:   the path before runtime/ops/fp8_block_gemm.py: the float8 weight dequantized to bf16
             (quant_gemv.fp8_dequantize) + cuBLAS (what XLLM_FP8_PREFILL=dequant keeps);
- block:     ops/fp8_block_gemm.py fp8_block_linear (FlashInfer's fp8_blockscale_gemm_sm90, JIT-built on first use;
             the bf16 input quantized per token and 128 columns inside), with the scales in 128 x 128 block form
             (the releases') and per row and 128 columns ("rows").
Timings: triton.testing.do_bench medians (ms) and TFLOP/s of 2 M N K. Every result is checked against the float32
product of the quantized operands (ActQuant's group round trip of x times the dequantized weight): max error
relative to the output's max.

    python bench/bench_fp8_prefill.py [--rows 512,2048,8192] [--out bench/results/x.md]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288)}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def _bench(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops import fp8_block_gemm as B
    from xllm_gen.runtime.ops import quant_gemv as Q

    dev = torch.device("cuda")
    torch.manual_seed(0)
    lines = [f"# float8 block-scaled prefill GEMMs ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "| shape | M | bf16 ms | dequant ms | block ms | block (rows) ms | bf16 TFLOP/s | block TFLOP/s | "
             "block vs bf16 | dequant vs bf16 | err block | err dequant |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    records = []
    for name, (N, K) in SHAPES.items():
        w16 = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        s_blk = (w16.float().reshape(N // 128, 128, K // 128, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
        s_full = s_blk.repeat_interleave(128, 0).repeat_interleave(128, 1)
        wq = (w16.float() / s_full).clamp(-448, 448).to(torch.float8_e4m3fn)
        s_row = s_blk.repeat_interleave(128, 0).contiguous()            # the layer's layout: [N, K / 128]
        w_deq32 = wq.float() * s_full
        for M in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            x_rt = ActQuant("group", 128).reference(x)                   # the reference's quantized input (bf16)
            ref = x_rt.float() @ w_deq32.T
            t_bf16 = _bench(lambda: F.linear(x, w16))
            y_deq = F.linear(x_rt, Q.fp8_dequantize(wq, s_row, (1, 128), torch.bfloat16))
            t_deq = _bench(lambda: F.linear(x_rt, Q.fp8_dequantize(wq, s_row, (1, 128), torch.bfloat16)))
            y_blk = B.fp8_block_linear(x_rt, wq, s_blk)
            t_blk = _bench(lambda: B.fp8_block_linear(x_rt, wq, s_blk))
            t_rows = _bench(lambda: B.fp8_block_linear(x_rt, wq, s_row))
            fl = 2 * M * N * K
            rec = dict(shape=name, M=M, N=N, K=K, bf16_ms=t_bf16, dequant_ms=t_deq, block_ms=t_blk,
                       block_rows_ms=t_rows, err_block=_rel(y_blk, ref), err_dequant=_rel(y_deq, ref))
            records.append(rec)
            lines.append(f"| {name} | {M} | {t_bf16:.4f} | {t_deq:.4f} | {t_blk:.4f} | {t_rows:.4f} | "
                         f"{fl / t_bf16 / 1e9:.0f} | {fl / t_blk / 1e9:.0f} | {t_blk / t_bf16:.2f}x | "
                         f"{t_deq / t_bf16:.2f}x | {rec['err_block']:.2e} | {rec['err_dequant']:.2e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
