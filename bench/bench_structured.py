"""The cost of structured outputs on the GPU: a decode batch of B requests (Qwen3-0.6B shapes, random bf16
weights) with none constrained, against the same batch with half the rows constrained by a JSON schema, in the
same process (TPOT medians over the requests; the constrained arm also split into its constrained and free
rows). A third arm runs the free batch with async scheduling off: constrained rows make a batch take
synchronous steps (each step's mask needs the previous token accepted), so that arm separates the cost of the
lost overlap from the mask's own (host fill + copy + apply, timed apart as `mask_ms_per_step`).

The tokenizer is synthetic but of Qwen's size (151,643 byte-level BPE tokens: bytes, words with and without a
leading space, digits, punctuation and JSON fragments), since the mask's host cost grows with the vocabulary.
The schema (an object holding an array of at least 64 small objects) cannot complete within the output length,
so every constrained row runs to max_tokens like the free ones.

    python bench/bench_structured.py --out bench/results/h100_structured.md [--batch 64 --in-len 256 --out-len 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False,
          "properties": {"items": {"type": "array", "minItems": 64, "items": {
              "type": "object", "required": ["id", "name", "tags"], "additionalProperties": False,
              "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}}}


def synthetic_tokenizer(out_dir: Path, size: int = 151643, seed: int = 0) -> None:
    """A byte-level BPE tokenizer with `size` tokens (no merges: only its vocabulary matters here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from xllm_gen.default_model import SPECIAL_TOKENS

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    rng = np.random.default_rng(seed)
    vocab: dict[str, int] = {}
    for c in sorted(byte_chars):
        vocab[c] = len(vocab)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    pieces = ['{"', '":', '",', '"}', '},', '[{', '}]', '": "', '", "', ' {', ' [', '0', '00', '12', '.', ',', ':']
    for p in pieces:
        vocab.setdefault(p.replace(" ", "Ġ"), len(vocab))
    while len(vocab) < size:
        r = rng.random()
        if r < 0.1:
            tok = "".join(rng.choice(list("0123456789"), rng.integers(1, 4)))
        elif r < 0.15:
            tok = "".join(rng.choice(list("{}[]\":,.!?-_()"), rng.integers(1, 4)))
        else:
            tok = "".join(rng.choice(list(letters), rng.integers(2, 11)))
            if rng.random() < 0.5:
                tok = "Ġ" + tok
        vocab.setdefault(tok, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    fast.save_pretrained(out_dir)


def drive(llm, prompts, out_len: int, constrained: set, timer: dict) -> dict:
    from xllm_gen import SamplingParams
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams

    engine = llm.engine
    so = StructuredOutputsParams(json=SCHEMA)
    seqs = [engine.make_sequence(i, {"prompt_token_ids": p},
                                 SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                                                structured_outputs=so if i in constrained else None))
            for i, p in enumerate(prompts)]
    torch.cuda.synchronize()
    timer["mask_s"], timer["mask_steps"] = 0.0, 0
    t0 = time.perf_counter()
    for s in seqs:
        engine.scheduler.add(s)
    first, end = {}, {}
    while engine.scheduler.has_unfinished():
        finished = engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.seq_id not in first and s.num_completion_tokens >= 1:
                first[s.seq_id] = now
        for s in finished:
            end[s.seq_id] = now
    errors = [s.error for s in seqs if s.error]
    assert not errors, errors[:3]
    assert all(s.num_completion_tokens == out_len for s in seqs), "a constrained row ended early"
    tpot = {s.seq_id: (end[s.seq_id] - first[s.seq_id]) / (out_len - 1) for s in seqs}
    return dict(tpot=tpot, total=time.perf_counter() - t0, mask_s=timer["mask_s"], mask_steps=timer["mask_steps"],
                texts=[engine.decode_text(s.completion_token_ids[:40]) for s in seqs[:1] + [seqs[i] for i in
                                                                                         sorted(constrained)[:1]]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h100_structured.md")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--in-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--root", default="/tmp/xllm_bench_structured")
    args = ap.parse_args(argv)
    import bench_decode as bd

    root = Path(args.root)
    model_dir = bd.write_config(root, "Qwen3-0.6B")
    if not (model_dir / "tokenizer.json").exists():
        synthetic_tokenizer(model_dir)
    B = args.batch
    llm, load_s = bd.make_llm(model_dir, max_num_seqs=B, max_model_len=args.in_len + args.out_len + 16,
                              num_kv_blocks=B * ((args.in_len + args.out_len) // 16 + 4), eager=args.eager)
    engine = llm.engine
    t0 = time.perf_counter()
    backend = engine.structured
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    backend.compile(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - t0
    timer: dict = {}
    apply = backend.apply

    def timed_apply(logits, matchers):
        t = time.perf_counter()
        apply(logits, matchers)
        timer["mask_s"] += time.perf_counter() - t
        timer["mask_steps"] += 1
    backend.apply = timed_apply

    rng = np.random.default_rng(0)
    vocab = 150000
    half = set(range(0, B, 2))
    arms = {"free": (set(), True), "free-sync": (set(), False), "half-json": (half, True)}
    drive(llm, rng.integers(0, vocab, (B, args.in_len)).tolist(), 8, half, timer)          # warm-up
    res: dict = {k: {"tpot": [], "tpot_c": [], "tpot_f": [], "mask_ms": []} for k in arms}
    async_dec = engine._async
    for run in range(args.runs):
        for name, (cons, use_async) in arms.items():
            engine._async = async_dec if use_async else None
            r = drive(llm, rng.integers(0, vocab, (B, args.in_len)).tolist(), args.out_len, cons, timer)
            res[name]["tpot"] += list(r["tpot"].values())
            res[name]["tpot_c"] += [v for i, v in enumerate(r["tpot"].values()) if i in cons]
            res[name]["tpot_f"] += [v for i, v in enumerate(r["tpot"].values()) if i not in cons]
            if r["mask_steps"]:
                res[name]["mask_ms"].append(1e3 * r["mask_s"] / r["mask_steps"])
            if name == "half-json" and run == 0:
                res["sample"] = r["texts"]
    engine._async = async_dec
    med = lambda xs: 1e3 * statistics.median(xs) if xs else None      # noqa: E731
    rows = {k: {"tpot_ms": med(v["tpot"]), "tpot_constrained_ms": med(v["tpot_c"]), "tpot_free_ms": med(v["tpot_f"]),
                "mask_ms_per_step": statistics.median(v["mask_ms"]) if v["mask_ms"] else None}
            for k, v in res.items() if k != "sample"}
    base = rows["free"]["tpot_ms"]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": B, "in_len": args.in_len,
           "out_len": args.out_len, "runs": args.runs, "graphs": not args.eager, "load_s": load_s,
           "tokenizer_info_s": info_s, "schema_compile_s": compile_s, "vocab": engine.vocab_size, "arms": rows,
           "overhead_vs_free_pct": {k: 100 * (r["tpot_ms"] / base - 1) for k, r in rows.items()},
           "sample_outputs": res.get("sample")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))
    L = [f"# Structured outputs on {out['gpu']}", "",
         f"Qwen3-0.6B shapes, random bf16 weights, batch {B}, input {args.in_len}, output {args.out_len}, greedy, "
         f"{'CUDA graphs' if out['graphs'] else 'eager'}, {args.runs} runs; TPOT medians over requests. "
         f"Command: `python bench/bench_structured.py {' '.join(argv or sys.argv[1:])}`", "",
         f"Tokenizer info {info_s:.2f} s (once per server), schema compile {compile_s * 1e3:.0f} ms (once per "
         "schema, cached), vocabulary " + str(engine.vocab_size), "",
         "| arm | TPOT ms | vs free | constrained rows | free rows | mask ms / step |",
         "| --- | --- | --- | --- | --- | --- |"]
    for k, r in rows.items():
        f = lambda x: "-" if x is None else f"{x:.3f}"                  # noqa: E731
        L.append(f"| {k} | {f(r['tpot_ms'])} | {out['overhead_vs_free_pct'][k]:+.1f}% | "
                 f"{f(r['tpot_constrained_ms'])} | {f(r['tpot_free_ms'])} | {f(r['mask_ms_per_step'])} |")
    L += ["", "free: no row constrained (async scheduling on); free-sync: the same with async scheduling off; "
          "half-json: every other row constrained by the JSON schema in bench/bench_structured.py.", ""]
    Path(args.out).write_text("\n".join(L))
    print("\n".join(L))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
