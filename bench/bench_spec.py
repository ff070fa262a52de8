"""Speculative decoding benchmark: TPOT of greedy decoding without speculation and with it, in one call, on
random bf16 weights of a real shape (Qwen3-0.6B by default, from specs/qwen3.yaml `variants`).

    python bench/bench_spec.py --out bench/results/h200_spec.md           # ~3-5 min on an H200
    python bench/bench_spec.py --batch-sizes 1,8 --out-len 64 --time-limit 300

Arms (each its own engine, CUDA graphs on):
  nospec          the baseline;
  draft=target    draft_model with the target's own shape and (dummy) weights: acceptance ~1, the upper bound of
                  what k drafts can give (k+1 tokens per verification, minus the draft's k decode steps);
  draft-shuffled  the same draft with its vocabulary rows permuted: acceptance ~0, the overhead of speculation
                  (k draft steps and a (k+1)-token verification for one token);
  ngram           prompt lookup on the random prompts (mostly misses: the cost of looking).
TPOT = (finish - first token) / (output - 1) per request, median; acceptance = accepted / verified drafts.
Every arm runs under the --time-limit left; one that fails or runs out prints why and the rest still run.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import rand_prompts, write_config  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def drive(llm, prompts: list[list[int]], out_lens: list[int], device: str) -> dict:
    """All requests at once through the engine's step loop (as bench_decode.drive); per-request TPOT (seconds)."""
    from xllm_gen import SamplingParams
    engine = llm.engine
    seqs = [engine.make_sequence(i, {"prompt_token_ids": p},
                                 SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, out_lens))]
    _sync(device)
    for s in seqs:
        engine.scheduler.add(s)
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    while engine.scheduler.has_unfinished():
        finished = engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.seq_id not in first and s.num_completion_tokens >= 1:
                first[s.seq_id] = now
        for s in finished:
            end[s.seq_id] = now
    return dict(tpot=[(end[s.seq_id] - first[s.seq_id]) / (n - 1) for s, n in zip(seqs, out_lens) if n > 1])


def _shuffle_vocab_rows(runner, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            if p.dim() == 2 and p.shape[0] >= vocab and ("embed" in name or "lm_head" in name):
                p.copy_(p[torch.randperm(p.shape[0], generator=g).to(p.device)])


def make(model_dir: Path, arm: str, k: int, args):
    from xllm_gen import LLM
    blocks = args.num_kv_blocks
    spec = None
    if arm.startswith("draft"):
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k, "num_kv_blocks": blocks}
    elif arm == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              load_format="auto" if args.model_dir else "dummy",
              max_model_len=args.in_len + args.out_len + k + 8, num_kv_blocks=blocks, enable_prefix_caching=False,
              speculative_config=spec)
    if arm == "draft-shuffled":
        _shuffle_vocab_rows(llm.engine.spec.proposer.runner, llm.engine.vocab_size)
    return llm


def run_arm(model_dir: Path, arm: str, k: int, args, deadline: float, log) -> dict:
    llm = make(model_dir, arm, k, args)
    rows = {}
    try:
        rng = np.random.default_rng(0)
        vocab = llm.engine.vocab_size
        for B in args.batch_sizes:
            if time.monotonic() > deadline:
                log(f"  {arm} B={B}: skipped (time limit)")
                break
            drive(llm, rand_prompts(rng, vocab, B, args.in_len), [8] * B, args.device)          # warm-up
            before = dict(llm.engine.stats)
            tpot = []
            for _ in range(args.runs):
                r = drive(llm, rand_prompts(rng, vocab, B, args.in_len), [args.out_len] * B, args.device)
                tpot += r["tpot"]
            st = llm.engine.stats
            drafted = st["spec_draft_tokens"] - before["spec_draft_tokens"]
            acc = (st["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / drafted if drafted else None
            rows[B] = dict(tpot_ms=1e3 * statistics.median(tpot), acceptance=acc)
            log(f"  {arm:15s} B={B:<4d} TPOT {rows[B]['tpot_ms']:.3f} ms  acceptance "
                f"{'-' if acc is None else f'{acc:.3f}'}")
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-0.6B", help="a variant of specs/qwen3.yaml (random weights)")
    ap.add_argument("--model-dir", default=None, help="a checkpoint dir instead (its weights; the draft = it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--in-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--arms", default="nospec,draft=target,draft-shuffled,ngram")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds for all arms (the rest are skipped)")
    ap.add_argument("--out", default=None, help="markdown table (and .json beside it)")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_spec: no CUDA GPU here (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.time_limit

    def log(msg):
        print(msg, flush=True)
    model_dir = Path(args.model_dir) if args.model_dir else write_config(Path(tempfile.mkdtemp(prefix="bench_spec_")),
                                                                          args.model)
    results = {}
    for arm in args.arms.split(","):
        if time.monotonic() > deadline:
            log(f"{arm}: skipped (time limit)")
            continue
        t0 = time.monotonic()
        try:
            results[arm] = run_arm(model_dir, arm,
                                   args.num_speculative_tokens, args, deadline, log)
            log(f"{arm}: done in {time.monotonic() - t0:.0f} s")
        except Exception as e:
            log(f"{arm}: FAILED ({type(e).__name__}: {e})")
            traceback.print_exc()
            results[arm] = {"error": f"{type(e).__name__}: {e}"}
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    what = args.model_dir or f"{args.model} (random weights)"
    lines = [f"# Speculative decoding, {what}, {args.dtype}, {where}", "",
             f"input {args.in_len}, output {args.out_len}, k = {args.num_speculative_tokens}, greedy, "
             f"{'CUDA graphs' if args.device == 'cuda' else 'eager'}; TPOT median ms (acceptance rate)", "",
             "| arm | " + " | ".join(f"B={b}" for b in args.batch_sizes) + " |",
             "|---|" + "---|" * len(args.batch_sizes)]
    for arm, rows in results.items():
        cells = []
        for b in args.batch_sizes:
            r = rows.get(b) if isinstance(rows, dict) else None
            if not r:
                cells.append(rows.get("error", "-") if isinstance(rows, dict) and "error" in rows else "-")
            else:
                cells.append(f"{r['tpot_ms']:.3f}" + (f" ({r['acceptance']:.2f})" if r["acceptance"] is not None else ""))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1,
                                                                  default=str))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
