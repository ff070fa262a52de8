"""Serving benchmark over HTTP (like `vllm bench serve`): drives a running `xllm-gen-serve` with streaming
/v1/completions requests and reports TTFT / TPOT / ITL / E2E percentiles and throughput.

    python bench/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --input-len 1024 --output-len 256 [--shared-prefix-len 512] [--max-concurrency 64] [--json out.json]

Arrivals: Poisson at --request-rate requests/s (inf: all at once), optionally capped at --max-concurrency
requests in flight (fixed concurrency: --request-rate inf --max-concurrency N). Prompts are random token ids
(exact lengths, no tokenizer needed), optionally sharing a common prefix of --shared-prefix-len tokens (for
prefix caching). Every request asks for exactly --output-len tokens (ignore_eos).

TTFT: request sent -> first token. ITL: gaps between streamed chunks that carry tokens. TPOT per request:
(E2E - TTFT) / (output tokens - 1). Needs only httpx."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def _pct(xs: list, p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_prompts(n: int, input_len: int, shared_prefix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = 100                                     # avoid the lowest ids (often special in small vocabularies)
    prefix = [rng.randrange(low, vocab) for _ in range(min(shared_prefix_len, input_len))]
    return [prefix + [rng.randrange(low, vocab) for _ in range(input_len - len(prefix))] for _ in range(n)]


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = Result(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = str(chunk["error"])
                    return r
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if chunk["choices"][0]["text"] or chunk["choices"][0].get("finish_reason") is None:
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
        r.e2e = time.perf_counter() - t0
        r.ok = last is not None
        if not r.ok:
            r.error = "no tokens streamed"
    except Exception as e:                           # noqa: BLE001 - reported per request
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(args) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        models = (await client.get(args.base_url + "/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        prompts = make_prompts(args.num_prompts, args.input_len, args.shared_prefix_len, args.vocab_size, args.seed)
        rng = random.Random(args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(p):
            if sem is None:
                return await one_request(client, args.base_url, model, p, args.output_len)
            async with sem:
                return await one_request(client, args.base_url, model, p, args.output_len)

        for p in prompts[:args.warmup]:
            await one_request(client, args.base_url, model, p, min(args.output_len, 4))
        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]
    e2e = [r.e2e * 1e3 for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    report = {
        "model": model, "num_prompts": len(prompts), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "input_len": args.input_len,
        "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        report[name] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                        **{f"p{p}": _pct(xs, p) for p in (50, 90, 99)}}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    ap.add_argument("--model", help="model name (default: the server's first)")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, requests/s (inf: burst)")
    ap.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0: no cap)")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix common to every prompt")
    ap.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--warmup", type=int, default=2, help="short requests sent first (not measured)")
    ap.add_argument("--seed", type=int, default=0, help="prompt and arrival seed")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--json", help="also write the report to this file")
    args = ap.parse_args(argv)
    report = asyncio.run(run(args))
    print(f"{report['completed']}/{report['num_prompts']} requests in {report['duration_s']:.2f} s "
          f"({report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} output tok/s)")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[name]
        print(f"{name:8s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  p99 {s['p99']:9.2f}")
    if report["errors"]:
        print("errors:", *report["errors"], sep="\n  ", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
