"""The whole-layer decode kernel (runtime/ops/layer_kernel.py) alone: us per layer of the one-launch form and of each
stage (launched alone), for Qwen3-0.6B / -8B layer shapes, random bf16 weights, a 1k context per row, across launch
configs (tile budget, warps). Timed as CUDA-graph replays of a model's worth of layers over copies of the layer's
weights (at least 256 MB, so that weights stream from HBM as in a decode step).

    python bench/bench_layer_kernel.py --out bench/results/h200_layer_kernel_stages.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"Qwen3-0.6B": (1024, 16, 8, 128, 3072, 28), "Qwen3-8B": (4096, 32, 8, 128, 12288, 36)}


def graph_us(fn, layers: int, reps: int = 20) -> float:
    """Median us per layer of a CUDA graph of fn() (which launches `layers` layers)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--configs", default="16384:8,32768:8,8192:4",
                    help="tile_budget:num_warps[:pipeline[:programs per SM]], each also timed per stage")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_layer_kernel_stages.md"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layer_kernel needs a CUDA GPU", file=sys.stderr)
        return 2
    from xllm_gen.runtime.ops import layer_kernel as LK
    dev, dt = "cuda", torch.bfloat16
    P = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    rows_out = []
    for name in args.shapes.split(","):
        D, H, HK, HD, inter, layers = SHAPES[name]
        nqkv = (H + 2 * HK) * HD
        per_layer = 2 * (nqkv * D + D * H * HD + 2 * inter * D + D * inter)
        copies = max(1, -(-(256 << 20) // per_layer))
        W = [dict(wqkv=torch.randn(nqkv, D, device=dev, dtype=dt) * D ** -0.5,
                  wo=torch.randn(D, H * HD, device=dev, dtype=dt) * (H * HD) ** -0.5,
                  wgu=torch.randn(2 * inter, D, device=dev, dtype=dt) * D ** -0.5,
                  wd=torch.randn(D, inter, device=dev, dtype=dt) * inter ** -0.5) for _ in range(copies)]
        g1 = torch.ones(D, device=dev, dtype=dt)
        qw = torch.ones(HD, device=dev, dtype=dt)
        inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, device=dev).float() / HD))
        fr = torch.arange(args.context + 8, device=dev).float()[:, None] * inv[None]
        cs = torch.cat([fr.cos(), fr.sin()], -1)
        for M in [int(r) for r in args.rows.split(",")]:
            page = 16
            per_row = -(-args.context // page)
            npages = M * per_row
            kc = torch.randn(npages, page, HK, HD, device=dev, dtype=dt)
            vc = torch.randn(npages, page, HK, HD, device=dev, dtype=dt)
            indptr = torch.arange(0, npages + 1, per_row, dtype=torch.int32, device=dev)
            indices = torch.randperm(npages, device=dev).to(torch.int32)
            last = torch.full((M,), args.context - (per_row - 1) * page, dtype=torch.int32, device=dev)
            slots = (indices[indptr[1:].long() - 1].long() * page + last.long() - 1)
            pos = torch.full((M,), args.context - 1, device=dev, dtype=torch.long)
            x = torch.randn(M, D, device=dev, dtype=dt)
            res = torch.randn(M, D, device=dev, dtype=dt)
            for cfg in configs:
                budget, warps, pipe, per_sm = (list(cfg) + [0, 1])[:4]
                scratch = LK.LayerScratch(LK.LayerDims(D, H, HK, HD, inter, page), P * per_sm, dt, dev,
                                          tile_budget=budget, num_warps=warps, pipeline=pipe)

                def run(staged=False):
                    for i in range(layers):
                        w = W[i % copies]
                        LK.decoder_layer(x, res, g1, 0.0, 1e-6, w["wqkv"], None, qw, qw, 1e-6, pos, cs, slots, kc, vc,
                                         indptr, indices, last, HD ** -0.5, -1, w["wo"], g1, 0.0, 1e-6, w["wgu"],
                                         "silu", w["wd"], scratch, staged=staged)
                row = dict(shape=name, rows=M, budget=budget, warps=warps, pipeline=pipe, per_sm=per_sm,
                           config=scratch.config)
                try:        # the grid barriers need every program resident: check before launching
                    k = LK.decoder_layer(x, res, g1, 0.0, 1e-6, W[0]["wqkv"], None, qw, qw, 1e-6, pos, cs, slots, kc,
                                         vc, indptr, indices, last, HD ** -0.5, -1, W[0]["wo"], g1, 0.0, 1e-6,
                                         W[0]["wgu"], "silu", W[0]["wd"], scratch, staged="compile")
                    getattr(k, "_init_handles", lambda: None)()     # n_regs is read when the binary loads
                    smem = max(1, k.metadata.shared)
                    fit = min(65536 // max(1, k.n_regs * 32 * warps), 232448 // smem, 2048 // (32 * warps))
                    row.update(regs=k.n_regs, smem=k.metadata.shared, resident_per_sm=fit)
                    if fit < per_sm:
                        row["error"] = f"only {fit} programs fit per SM"
                        print(json.dumps(row), flush=True)
                        rows_out.append(row)
                        continue
                    row["one_launch_us"] = graph_us(run, layers)
                except Exception as e:          # a config that does not compile / fit is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
                    continue
                row["staged_us"] = graph_us(lambda: run(True), layers)
                for st in range(1, 6):
                    row[f"stage{st}_us"] = graph_us(lambda st=st: run([st]), layers)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    L = ["# Whole-layer decode kernel: us per layer (CUDA-graph replays, weights streamed from HBM)", "",
         f"`python bench/bench_layer_kernel.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
         f"{torch.cuda.get_device_name()}, torch {torch.__version__}, context {args.context}", "",
         "| shape | rows | tile budget | warps | pipeline | programs / SM | regs | one launch us | staged us | "
         "stage 1..5 us | config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        if "error" in r:
            L.append(f"| {r['shape']} | {r['rows']} | {r['budget']} | {r['warps']} | {r['pipeline']} | {r['per_sm']} | "
                     f"{r.get('regs', '')} | {r['error']} |  |  | {r['config']} |")
            continue
        st = " / ".join(f"{r[f'stage{i}_us']:.1f}" for i in range(1, 6)) if "stage1_us" in r else ""
        L.append(f"| {r['shape']} | {r['rows']} | {r['budget']} | {r['warps']} | {r['pipeline']} | {r['per_sm']} | "
                 f"{r.get('regs', '')} | {r['one_launch_us']:.1f} | "
                 f"{r.get('staged_us', float('nan')):.1f} | {st} | {r['config']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows_out, indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
