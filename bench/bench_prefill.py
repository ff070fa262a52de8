"""Prefill benchmark: how close a many-prompt prefill gets to the GPU's compute (issue 23, item 2).

For N prompts of L tokens (max_tokens=1, so the run is the prefill and one sampled token per request), through
the public API (`LLM.generate`, random bf16 weights of real Qwen3 shapes), it reports per step budget
(`max_num_batched_tokens`):
  - the wall time until every request has its first token (median of --runs),
  - the achieved TFLOP/s: linear-layer FLOPs (2 x parameters touched per token, the LM head only for the last
    token of each prompt) plus causal attention FLOPs (QK^T and PV over the lower triangle), divided by that time,
  - with --profile, one run under torch.profiler: GPU busy time, the host gap (wall - kernel time), and the top
    kernels grouped as GEMM / attention / norm-rope / other.

    python bench/bench_prefill.py --model Qwen3-0.6B --prompts 100 --input-len 1024 --budgets 8192,16384 --profile
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_decode import versions, write_config  # noqa: E402


def flops(cfg: dict, prompts: int, L: int) -> float:
    h, I, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * I
    linear = 2 * per_layer * n * prompts * L + 2 * h * cfg["vocab_size"] * prompts
    attention = 2 * 2 * hq * d * (L * (L + 1) / 2) * n * prompts        # QK^T and PV, causal
    return linear + attention


def kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "cutlass", "sm90", "nvjet", "cublas", "matmul", "xmma")):
        return "gemm"
    if any(s in n for s in ("attention", "prefill", "flashinfer", "fmha", "batchprefill")):
        return "attention"
    if any(s in n for s in ("norm", "rope", "rotary")):
        return "norm/rope"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-0.6B")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--budgets", default="8192,16384", help="max_num_batched_tokens values, one engine each")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-attention", default="fa2",
                    help="FlashInfer prefill kernel families to compare (fa2,fa3), one engine per budget each")
    ap.add_argument("--prefill-graphs", default="default",
                    help="piecewise prefill graph buckets to compare: 'default' (the engine's), a largest bucket "
                         "(e.g. 4096: the default buckets up to it), or 'none' (eager prefill)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--host-profile", action="store_true",
                    help="one more run under cProfile: the host functions by own time (where a host gap comes from)")
    ap.add_argument("--out", default=None, help="markdown output (stdout always)")
    args = ap.parse_args()

    from xllm_gen import LLM, SamplingParams
    root = Path(tempfile.mkdtemp())
    d = write_config(root, args.model)
    cfg = json.loads((d / "config.json").read_text())
    F = flops(cfg, args.prompts, args.input_len)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(1000, 20000, (args.input_len,), generator=g).tolist()}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lines = [f"## Prefill: {args.model}, {args.prompts} prompts x {args.input_len} tokens, max_tokens 1",
             "", f"versions: {versions()}", f"FLOPs per run: {F / 1e12:.2f} TFLOP (linear + causal attention)", "",
             "| prefill attention | prefill graphs | max_num_batched_tokens | wall ms (median) | runs ms | TFLOP/s |",
             "|---|---|---|---|---|---|"]
    profiles = []
    from xllm_gen.runtime.executor.prefill_graphs import DEFAULT_PREFILL_GRAPH_SIZES

    def graph_sizes(g: str):
        return None if g == "default" else [] if g == "none" else [b for b in DEFAULT_PREFILL_GRAPH_SIZES if b <= int(g)]
    runs = [(a, int(b), g) for g in args.prefill_graphs.split(",") for a in args.prefill_attention.split(",")
            for b in args.budgets.split(",")]
    for attn, budget, graphs in runs:
        llm = LLM(str(d), dtype="bfloat16", load_format="dummy", max_num_seqs=max(args.prompts, 16),
                  _debug={"prefill_attention": attn}, max_model_len=args.input_len + 16, max_num_batched_tokens=budget, enable_prefix_caching=False,
                  num_kv_blocks=(args.prompts * (args.input_len + 16)) // 16 + 64,
                  prefill_graph_sizes=graph_sizes(graphs))
        llm.generate(prompts[: min(8, len(prompts))], params, use_tqdm=False)       # warm-up (tuning, plans)
        times = []
        for _ in range(args.runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(times)
        lines.append(f"| {attn} | {graphs} | {budget} | {med:.1f} | {', '.join(f'{t:.1f}' for t in times)} | {F / med / 1e9:.0f} |")
        if args.host_profile:
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            profiles += ["", f"### Host profile (cProfile, by own time), {attn}, budget {budget}", "", "```",
                         buf.getvalue().strip(), "```"]
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
            groups: dict[str, float] = {}
            per_kernel = []
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
                if e.device_type.name == "CUDA" and t > 0:
                    groups[kind(e.key)] = groups.get(kind(e.key), 0.0) + t
                    per_kernel.append((t, e.count, e.key[:90]))
            busy = sum(groups.values())
            profiles += ["", f"### Profile, {attn}, budget {budget}: wall {wall:.1f} ms (profiler on), kernels {busy:.1f} ms,"
                         f" GPU idle {wall - busy:.1f} ms",
                         "", "| group | ms | share |", "|---|---|---|"]
            profiles += [f"| {k} | {v:.1f} | {v / busy:.0%} |" for k, v in sorted(groups.items(), key=lambda x: -x[1])]
            profiles += ["", "| kernel | ms | calls |", "|---|---|---|"]
            profiles += [f"| `{k}` | {t:.2f} | {c} |" for t, c, k in sorted(per_kernel, reverse=True)[:15]]
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    text = "\n".join(lines + profiles) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
