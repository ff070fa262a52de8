"""The Triton decode-attention kernel's launch parameters, swept: for each (batch, context) of a model's attention
shape, FlashInfer's CUDA-graph decode, the kernel as the engine launches it today (the split count `auto` picks,
64-token blocks, 4 warps, the merge head by head) and every (splits, block_n, num_warps, num_stages) of the grid, each timed as
runtime/attention/triton_decode.measure_decode_kernels does (a CUDA graph over copies of a random paged cache,
so the KV streams from HBM; us per layer). Says which launch parameters the kernel's tuning should search.

    python bench/bench_decode_attention_tune.py --out bench/results/h200_decode_attention_tune.md
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = {"Qwen3-0.6B": (16, 8, 128), "Qwen3-8B": (32, 8, 128)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_decode_attention_tune.md"))
    ap.add_argument("--models", default="Qwen3-0.6B")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--splits", default="8,16,32,64")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--stages", default="0", help="0: Triton's default")
    ap.add_argument("--merge", default="1,0", help="1: the group's merge vectorized, 0: head by head")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                    help="the cache's dtype (fp8: float8 e4m3, scale 1.0; queries stay bf16)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import flashinfer

    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper, decode_splits
    from xllm_gen.runtime.layers.linear import graph_time_ms
    ints = lambda s: [int(x) for x in s.split(",") if x]   # noqa: E731
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    rows_out, lines = [], []
    for model in args.models.split(","):
        H, HK, D = MODELS[model]
        for B, ctx in itertools.product(ints(args.batches), ints(args.contexts)):
            page = args.page_size
            per_row = -(-ctx // page)
            npages = B * per_row
            kv_dt = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
            kv_bytes = 2 * npages * page * HK * D * kv_dt.itemsize
            copies = int(max(2, min(64, -(-(128 << 20) // kv_bytes))))
            caches = [tuple(torch.randn(npages, page, HK, D, device=dev, dtype=torch.bfloat16).to(kv_dt) for _ in range(2))
                      for _ in range(copies)]
            indptr = torch.arange(0, npages + 1, per_row, dtype=torch.int32)
            indices = torch.randperm(npages, device=dev).to(torch.int32)
            last = torch.full((B,), ctx - (per_row - 1) * page, dtype=torch.int32)
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.to(dev))
            fi.plan(indptr, indices, last, H, HK, D, page, q_data_type=torch.bfloat16, kv_data_type=kv_dt)
            t_fi = 1e3 * graph_time_ms(lambda: [fi.run(q, kv) for kv in caches]) / copies
            ref = fi.run(q, caches[0]).float()

            def timed(s, bn, w, st, mv=None):
                wr = TritonDecodeWrapper(H, HK, D, s, B, dev, block_n=bn, num_warps=w, num_stages=st or None,
                                         merge_vec=None if mv is None else bool(mv))
                wr.plan(indptr, indices, last, H, HK, D, page)
                err = (wr.run(q, caches[0]).float() - ref).abs().max().item()
                if err > 2e-2:
                    raise AssertionError(f"config {(s, bn, w, st)} differs from FlashInfer by {err}")
                return 1e3 * graph_time_ms(lambda: [wr.run(q, kv) for kv in caches]) / copies

            auto_s = decode_splits(B, HK, sms, "triton")
            t_now = timed(auto_s, 64, 4, None, 0)          # the kernel as it was: 64-token blocks, 4 warps, merge by head
            grid = {}
            for cfg in itertools.product(ints(args.splits), ints(args.block_n), ints(args.warps), ints(args.stages),
                                         ints(args.merge)):
                try:
                    grid[cfg] = timed(*cfg)
                except Exception as e:       # noqa: BLE001 - a config Triton cannot build (shared memory): skipped
                    print(f"skip {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min(grid, key=grid.get)
            top = sorted(grid, key=grid.get)[:5]
            row = dict(model=model, kv_dtype=args.kv_dtype, batch=B, context=ctx, kv_gb_per_s=kv_bytes / grid[best] / 1e3, flashinfer_us=t_fi, now_us=t_now, now_splits=auto_s,
                       best=list(best), best_us=grid[best], top=[[list(k), grid[k]] for k in top])
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            lines.append(f"| {model} | {B} | {ctx} | {t_fi:.2f} | {t_now:.2f} ({auto_s}) | {grid[best]:.2f} "
                         f"{best} | " + ", ".join(f"{k}: {grid[k]:.2f}" for k in top[1:]) + " |")
    ver = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__}
    import triton
    ver["triton"] = triton.__version__
    md = [f"# Decode attention: the Triton kernel's launch parameters swept ({args.kv_dtype} KV, pages of "
          f"{args.page_size}, shuffled)", "", f"- command: `python {' '.join(sys.argv)}`", f"- versions: {ver}",
          "- us per call (one layer), median of 20 graph replays; config = (splits, block_n, num_warps, num_stages, merge vectorized)", "",
          "| model | batch | context | FlashInfer us | Triton now us (splits) | best us (config) | next best |",
          "|---|---|---|---|---|---|---|"] + lines
    Path(args.out).write_text("\n".join(md) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows_out, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
