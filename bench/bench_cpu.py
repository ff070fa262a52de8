"""CPU decode step: the engine (torch paged backend, float32) beside Hugging Face transformers eager (dynamic
cache) on the same checkpoint, in the same run. Default: the embedded tiny default model (no download).

    python bench/bench_cpu.py [--model DIR] [--batch-sizes 1,64] [--prompt-len 32] [--steps 32] [--threads N]

A step is one decode forward of the whole batch: for the engine, `LLMEngine.step()` once every request is past
its prefill (scheduling, the forward, sampling, bookkeeping); for HF, one `model(input_ids[:, -1:],
past_key_values=...)` plus the argmax. Medians over the steps; ratio = engine / HF."""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch


def engine_steps(model: str, batch: int, prompt_len: int, steps: int) -> list[float]:
    from xllm_gen import LLM, SamplingParams

    rng = random.Random(0)
    with LLM(model=model, device="cpu", dtype="float32", max_num_seqs=max(batch, 1), enable_prefix_caching=False,
             max_model_len=prompt_len + steps + 8) as llm:
        engine = llm.engine
        vocab = min(engine.vocab_size, 400)
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        for i in range(batch):
            engine.add_request(i, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}, params)
        times = []
        while engine.num_requests():
            # a decode step: every request already has its first token (its prefill is done)
            decoding = all(s.num_completion_tokens > 0 for seqs in engine._requests.values() for s in seqs)
            t = time.perf_counter()
            engine.step_outputs()
            if decoding:
                times.append(time.perf_counter() - t)
        return times


def hf_steps(model: str, batch: int, prompt_len: int, steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(0)
    vocab = min(hf.config.vocab_size, 400)
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)])
    times = []
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps - 1):
            t = time.perf_counter()
            out = hf(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from xllm_gen import default_model as tiny
        model = str(tiny.make_default_checkpoint(tempfile.mkdtemp(prefix="xllm_bench_cpu_")))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {model}")
    print("| batch | engine step ms (median) | HF eager step ms (median) | engine / HF |")
    print("|---|---|---|---|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        e = statistics.median(engine_steps(model, b, args.prompt_len, args.steps)) * 1e3
        h = statistics.median(hf_steps(model, b, args.prompt_len, args.steps)) * 1e3
        print(f"| {b} | {e:.2f} | {h:.2f} | {e / h:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
