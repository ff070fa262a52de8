"""Fused decode prologues, A/B in one call: Qwen3-0.6B (random bf16 weights) graph decode with
XLLM_FUSED_DECODE=0 (plain ops), auto (a GEMV prologue fused where the runner's start-up measurement
found the fused kernel faster than the plain op + GEMM; the rotary + KV store always) and 1 (fused wherever it
applies), one engine per mode, built one after another in this process.

    python bench/bench_fused_decode.py --batches 1,4,8 --out bench/results/h200_fused_decode.md

Per mode and batch: TPOT (median ms, engine step loop, input --input-len, output --output-len tokens), the GPU time
of one decode-graph replay (CUDA events), and the kernel launches of one replay per decoder layer (torch.profiler,
kernels of one replay / num_hidden_layers; the lm_head and embedding launches are counted in too, so this is a
slight over-count). Also the greedy tokens of each mode at batch 1 (first 32), which agree up to bf16 near-ties.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
MODES = {"off": "0", "auto": "auto", "on": "1"}  # XLLM_FUSED_DECODE per mode


def launches_per_replay(graph, reps: int = 3) -> tuple[float, list]:
    """Kernel launches of one graph replay (torch.profiler, CUDA activity, as bench_decode.profile_decode reads it;
    memcpy / memset left out) and the most frequent kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    key = "device_time_total" if ka and hasattr(ka[0], "device_time_total") else "cuda_time_total"
    rows = [(e.key[:70], e.count / reps) for e in ka
            if getattr(e, key) > 0 and "memcpy" not in e.key.lower() and "memset" not in e.key.lower()]
    return sum(c for _, c in rows), sorted(rows, key=lambda kv: -kv[1])[:12]


def main(argv=None) -> int:
    import bench_decode as BD
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--modes", default="off,auto,on",
                    help="comma list of off, auto, on; +pdl / +pdlwait / +pdllate adds programmatic dependent launch "
                         "(runtime/ops/pdl.py: XLLM_PDL=1 / wait / late), e.g. off,auto,auto+pdllate; +nomma keeps "
                         "9..64 rows unfused (the tensor-core fused GEMVs off: XLLM_FUSED_MMA=0); +launch also times the "
                         "decode-attention kernel's (BLOCK_N, warps) (XLLM_DECODE_LAUNCH_TUNING=1); +nolayer keeps the "
                         "whole-layer decode kernel off (XLLM_LAYER_KERNEL=0), +staged runs its five stages as five "
                         "launches")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--variant", default="Qwen3-0.6B")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_fused_decode.md"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from xllm_gen import SamplingParams
    from xllm_gen.runtime.attention import triton_decode as TD
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import layer_kernel as LKL
    from xllm_gen.runtime.ops import pdl as PDL
    LAUNCH_CANDIDATES = TD.LAUNCH_CANDIDATES
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    d = BD.write_config(Path(tempfile.mkdtemp(prefix="xllm_fused_")), args.variant)
    layers = BD.variant(args.variant)["num_hidden_layers"]
    R: dict = dict(versions=BD.versions(), variant=args.variant, input_len=args.input_len, output_len=args.output_len,
                   command="python bench/bench_fused_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   rows=[], tokens={})
    for mode in modes:
        fused, *extra = mode.split("+")
        launch = next((e for e in extra if e not in ("nomma", "launch", "nolayer", "staged")), "")
        # the whole-layer kernel (runtime/layers/layer_kernel.py): on by default; +nolayer off, +staged five launches
        LKL.MODE = "0" if "nolayer" in extra else "staged" if "staged" in extra else "1"
        FU.MODE = MODES[fused]
        FU._FUSED_MAX_ROWS = 8 if "nomma" in extra else 64     # +nomma: 9..64 rows unfused (XLLM_FUSED_MMA=0)
        # +launch: the decode-attention kernel's launch timed too (XLLM_DECODE_LAUNCH_TUNING=1)
        TD.LAUNCH_CANDIDATES = ((16, 2), (32, 2), (64, 2)) if "launch" in extra else LAUNCH_CANDIDATES
        TD.DECODE_KERNEL_CHOICE.clear()
        PDL.MODE = {"": "0", "pdl": "1", "pdlwait": "wait", "pdllate": "late"}[launch]
        t0 = time.perf_counter()
        llm, _ = BD.make_llm(d, max_num_seqs=max(batches), max_model_len=args.input_len + args.output_len + 16,
                             num_kv_blocks=max(batches) * ((args.input_len + args.output_len) // 16 + 2) + 64)
        print(f"[{mode}] engine built in {time.perf_counter() - t0:.1f} s; decode attention (rows, ...) -> "
              f"(splits, BLOCK_N, warps) or 0 (FlashInfer): "
              f"{ {k[0]: v for k, v in TD.DECODE_KERNEL_CHOICE.items()} }", flush=True)
        g = llm.engine.runner.graphs
        for B in batches:
            r = BD.bench_batch(llm, B, args.input_len, args.output_len, args.runs, seed=B)
            Bk = g.bucket_for(B)
            n, top = launches_per_replay(g.graphs[Bk])
            row = dict(mode=mode, batch=B, bucket=Bk, tpot_ms=r["tpot_ms"], tpot_min_ms=r["tpot_min_ms"],
                       replay_ms=BD._ev_ms(g.graphs[Bk].replay, 50), launches=n, launches_per_layer=n / layers,
                       top_kernels=top)
            R["rows"].append(row)
            print(f"[{mode}] batch {B}: TPOT {row['tpot_ms']:.3f} ms, replay {row['replay_ms']:.3f} ms, "
                  f"{n:.0f} launches ({n / layers:.1f} per layer)", flush=True)
        rng = np.random.default_rng(0)
        prompt = BD.rand_prompts(rng, llm.engine.vocab_size, 1, 64)[0]
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        R["tokens"][mode] = out[0].outputs[0].token_ids
        R.setdefault("fused_tuning", {str(k): v for k, v in FU.FUSED_TUNING.items()})
        llm.shutdown()
        del llm
        BD.free_cuda()
    base = {r["batch"]: r for r in R["rows"] if r["mode"] == modes[0]}
    L = [f"# Fused decode prologues: {args.variant}, graph decode, input {args.input_len}, output {args.output_len}\n",
         f"`{R['command']}`; {R['versions']}\n",
         "| mode | batch | TPOT ms | min TPOT ms | replay ms | launches / layer | TPOT vs " + modes[0] + " |",
         "|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        b = base.get(r["batch"])
        L.append(f"| {r['mode']} | {r['batch']} | {r['tpot_ms']:.3f} | {r['tpot_min_ms']:.3f} | {r['replay_ms']:.3f} | "
                 f"{r['launches_per_layer']:.1f} | {r['tpot_ms'] / b['tpot_ms']:.3f} |" if b else "")
    same = {m: R["tokens"][m] == R["tokens"][modes[0]] for m in modes}
    L += ["", f"Greedy tokens at batch 1 equal to {modes[0]}'s: {same}", "",
          "Fused GEMV tuning, (prologue, rows, N, K): (plain op + GEMM us, fused us, config); the fused kernel is "
          "used (auto) where it is faster:", ""]
    L += [f"- {k}: {v[0]:.2f} / {v[1]:.2f} us {v[2]}" for k, v in (R.get("fused_tuning") or {}).items()]
    L.append("")
    for r in R["rows"]:
        L.append(f"- {r['mode']} b{r['batch']} top kernels of one replay: {r['top_kernels']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
    print("\n".join(L[:4 + len(R["rows"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
