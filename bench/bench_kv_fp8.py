"""FP8 KV cache against the model-dtype KV cache at a long context, A/B in one call: Qwen3-0.6B (random bf16
weights) graph decode, kv_cache_dtype "auto" (bf16), "fp8" (float8 e4m3, scale 1.0) and "fp8" with per-tensor KV
scales on every layer (as a checkpoint's k_scale / v_scale give them: FlashInfer's run(k_scale=, v_scale=), an
output multiply per layer), one engine each.

    python bench/bench_kv_fp8.py --context 32768 --batches 1,4 --out bench/results/h200_kv_fp8.md

Per KV dtype and batch: TPOT (median ms over the decode steps, engine step loop), TTFT of the batch, the KV bytes
a decode step reads at that context, and the greedy tokens of batch 1 (first 16) for both dtypes.
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


def main(argv=None) -> int:
    import bench_decode as BD
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--variant", default="Qwen3-0.6B")
    ap.add_argument("--kv", default="auto,fp8,fp8-scaled", help="the caches to run, in order (auto: the model dtype)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_kv_fp8.md"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_fp8 needs a CUDA GPU", file=sys.stderr)
        return 2
    from xllm_gen import LLM, SamplingParams
    batches = [int(b) for b in args.batches.split(",")]
    d = BD.write_config(Path(tempfile.mkdtemp(prefix="xllm_kvfp8_")), args.variant)
    cfg = BD.variant(args.variant)
    max_len = args.context + args.output_len + 16
    R: dict = dict(versions=BD.versions(), variant=args.variant, context=args.context, output_len=args.output_len,
                   command="python bench/bench_kv_fp8.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   rows=[], tokens={})
    for kv in args.kv.split(","):
        t0 = time.perf_counter()
        llm = LLM(str(d), dtype="bfloat16", load_format="dummy", kv_cache_dtype=kv.split("-")[0],
                  max_num_seqs=max(batches), max_model_len=max_len,
                  num_kv_blocks=max(batches) * (max_len // 16 + 2) + 64, enable_prefix_caching=False,
                  _debug={"kv_scales": (0.75, 1.5)} if kv == "fp8-scaled" else None)
        kc = next(m.k_cache for m in llm.engine.runner.model.modules() if getattr(m, "k_cache", None) is not None
                  and m.k_cache.numel())
        print(f"[kv {kv}] engine built in {time.perf_counter() - t0:.1f} s, cache {kc.dtype}", flush=True)
        kv_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * kc.element_size()
        for B in batches:
            r = BD.bench_batch(llm, B, args.context, args.output_len, args.runs, seed=B)
            row = dict(kv=kv, cache_dtype=str(kc.dtype) + (" scaled" if kv == "fp8-scaled" else ""), batch=B, tpot_ms=r["tpot_ms"], tpot_min_ms=r["tpot_min_ms"],
                       ttft_ms=r["ttft_ms"], kv_gb_per_step=B * args.context * kv_bytes / 1e9)
            R["rows"].append(row)
            print(f"[kv {kv}] batch {B}: TPOT {row['tpot_ms']:.3f} ms, TTFT {row['ttft_ms']:.1f} ms, "
                  f"KV read per step {row['kv_gb_per_step']:.2f} GB", flush=True)
        rng = np.random.default_rng(0)
        prompt = BD.rand_prompts(rng, llm.engine.vocab_size, 1, 512)[0]
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=16,
                                                                          ignore_eos=True))
        R["tokens"][kv] = out[0].outputs[0].token_ids
        llm.shutdown()
        del llm
        BD.free_cuda()
    base = {r["batch"]: r for r in R["rows"] if r["kv"] == "auto"}
    L = [f"# FP8 KV cache: {args.variant}, graph decode at a {args.context}-token context, output {args.output_len}\n",
         f"`{R['command']}`; {R['versions']}\n",
         "| KV cache | batch | TPOT ms | min TPOT ms | TTFT ms | KV GB read / step | TPOT vs bf16 KV |",
         "|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        b = base.get(r["batch"], r)
        L.append(f"| {r['cache_dtype']} | {r['batch']} | {r['tpot_ms']:.3f} | {r['tpot_min_ms']:.3f} | "
                 f"{r['ttft_ms']:.1f} | {r['kv_gb_per_step']:.2f} | {r['tpot_ms'] / b['tpot_ms']:.3f} |")
    toks = R["tokens"]
    L += ["", "Greedy tokens at batch 1 (512-token prompt, random weights): " + ", ".join(f"{k} KV {v}" for k, v in
                                                                                     toks.items())
          + (f" (bf16 == fp8: {toks['auto'] == toks['fp8']})" if "auto" in toks and "fp8" in toks else ""), ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
