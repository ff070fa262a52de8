"""Decode attention alone: FlashInfer's CUDA-graph decode wrapper (tensor cores, split KV + merge kernel, what
the engine used for every bucket) against the Triton split-KV kernel that merges in the same launch
(runtime/ops/decode_attention.py), over batch sizes and context lengths, on Qwen3-0.6B and Qwen3-8B attention
shapes (16 / 32 query heads, 8 KV heads, head_dim 128, bf16, pages of 16 shuffled). Each timing replays a CUDA
graph of `layers` calls, each on its own layer's cache (so the KV streams from HBM as in a model), median of 20
replays; GB/s counts the K/V bytes a call reads. The Triton kernel runs with the split count the engine would
pick (`decode_splits`) and with the others listed in --splits.

    python bench/bench_attention.py [--out bench/results/h200_attention.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = {"Qwen3-0.6B": (16, 8, 128), "Qwen3-8B": (32, 8, 128), "Qwen3-30B-A3B": (32, 4, 128)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_attention.md"))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256,1024,4096,16384")
    ap.add_argument("--splits", default="4,8,16,32")
    ap.add_argument("--models", default="Qwen3-0.6B")
    ap.add_argument("--max-gib", type=float, default=24.0, help="KV bytes per timing (fewer layers above)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper, decode_splits
    from xllm_gen.runtime.executor.context import ForwardContext
    from xllm_gen.runtime.layers.linear import graph_time_ms
    from xllm_gen.runtime.ops import reference as R

    dev, dt, page = torch.device("cuda"), torch.bfloat16, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = []
    for model in args.models.split(","):
        H, Hk, D = MODELS[model]
        for ctx_len in [int(c) for c in args.contexts.split(",")]:
            for B in [int(b) for b in args.batches.split(",")]:
                npages = (ctx_len + page - 1) // page
                kv_bytes = 2 * B * ctx_len * Hk * D * 2
                layers = int(max(2, min(20, args.max_gib * 2 ** 30 // kv_bytes)))
                caches = [(torch.randn(B * npages, page, Hk, D, device=dev, dtype=dt),
                           torch.randn(B * npages, page, Hk, D, device=dev, dtype=dt)) for _ in range(layers)]
                perm = torch.randperm(B * npages, device=dev).to(torch.int32)
                indptr = torch.arange(0, B * npages + 1, npages, dtype=torch.int32)
                last = torch.full((B,), ctx_len - (npages - 1) * page, dtype=torch.int32)
                q = torch.randn(B, H, D, device=dev, dtype=dt)
                ctx = ForwardContext(is_prefill=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=dev),
                                     seq_lens=torch.full((B,), ctx_len, dtype=torch.int32, device=dev),
                                     slot_mapping=torch.full((B,), -1, device=dev),
                                     block_tables=perm.view(B, npages), block_size=page,
                                     seq_lens_cpu=[ctx_len] * B, query_lens_cpu=[1] * B)
                fi = FlashInferBackend(H, Hk, D, dt, dev, block_size=page, max_batch=B, max_model_len=ctx_len,
                                       max_num_tokens=B, graph_buckets=(B,), decode_kernel="flashinfer")
                fi.plan(ctx)
                scale = D ** -0.5
                t_fi = graph_time_ms(lambda: [fi.forward(q, None, None, k, v, ctx, scale) for k, v in caches],
                                     reps=20) / layers
                want = R.paged_decode_attention(q[:2], caches[0][0], caches[0][1], indptr[:3], perm.cpu(), last[:2],
                                                scale).to(dev)
                row = dict(model=model, batch=B, context=ctx_len, layers=layers, flashinfer_us=t_fi * 1e3,
                           auto_splits=decode_splits(B, Hk, sms), triton_us={})
                row["fi_err"] = (fi.forward(q, None, None, *caches[0], ctx, scale)[:2].float() - want.float()).abs().max().item()
                for S in sorted({decode_splits(B, Hk, sms, "triton")} | {int(s) for s in args.splits.split(",")}):
                    w = TritonDecodeWrapper(H, Hk, D, S, B, dev)
                    w.plan(indptr, perm, last, H, Hk, D, page, sm_scale=scale)
                    t = graph_time_ms(lambda: [w.run(q, kv) for kv in caches], reps=20) / layers
                    row["triton_us"][S] = t * 1e3
                    row[f"triton_err_{S}"] = (w.run(q, caches[0])[:2].float() - want.float()).abs().max().item()
                best = min(row["triton_us"], key=row["triton_us"].get)
                row["best_splits"], row["gbs_fi"] = best, kv_bytes / t_fi / 1e6
                row["gbs_triton_best"] = kv_bytes / row["triton_us"][best] / 1e3
                res.append(row)
                print(json.dumps(row), flush=True)
                caches.clear()
                torch.cuda.empty_cache()
    v = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev)}
    try:
        import flashinfer
        import triton
        v.update(flashinfer=flashinfer.__version__, triton=triton.__version__)
    except ImportError:
        pass
    L = ["# Decode attention alone: FlashInfer (graph decode wrapper) vs the Triton split-KV kernel (bf16)\n",
         f"- command: `python bench/bench_attention.py {' '.join(argv or sys.argv[1:])}`",
         f"- versions: {v}",
         "- us per call (one layer), median of 20 graph replays; splits: the engine's choice (auto) and the others\n",
         "| model | batch | context | FlashInfer us | Triton us at auto splits (S) | best Triton us (S) | "
         "FlashInfer GB/s | best Triton GB/s |", "|---|---|---|---|---|---|---|---|"]
    for r in res:
        a = r["auto_splits"] or decode_splits(r["batch"], MODELS[r["model"]][1], sms, "triton")
        L.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['flashinfer_us']:.2f} | "
                 f"{r['triton_us'][a]:.2f} ({a}{'' if r['auto_splits'] else ', FlashInfer chosen'}) | "
                 f"{r['triton_us'][r['best_splits']]:.2f} ({r['best_splits']}) | {r['gbs_fi']:.0f} | "
                 f"{r['gbs_triton_best']:.0f} |")
    Path(args.out).write_text("\n".join(L) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(res, indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
