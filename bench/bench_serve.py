"""Serving benchmark over HTTP (like `vllm bench serve`): drives a running `xllm-gen-serve` with streaming
/v1/completions requests and reports TTFT / TPOT / ITL / E2E percentiles and throughput.

    python bench/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --input-len 1024 --output-len 256 [--shared-prefix-len 512] [--max-concurrency 64] [--json out.json]

Arrivals: Poisson at --request-rate requests/s (inf: all at once), optionally capped at --max-concurrency
requests in flight (fixed concurrency: --request-rate inf --max-concurrency N). Prompts are random token ids
(exact lengths, no tokenizer needed), optionally sharing a common prefix of --shared-prefix-len tokens (for
prefix caching). Every request asks for exactly --output-len tokens (ignore_eos).

Comparing the server's layouts in one call (the issue-23 target: serving at concurrency 64 >= 0.9x offline
LLM.generate req/s on the same prompts, ITL p99 <= 2x p50):

    python bench/bench_serve.py --serve MODEL_DIR --modes core,in-process,offline \
        --serve-args "--load-format dummy --dtype bfloat16 --max-model-len 2048" \
        --num-prompts 64 --max-concurrency 64 --input-len 1024 --output-len 129 [--json out.json]

starts `xllm-gen-serve MODEL_DIR --port FREE SERVE_ARGS` once per mode (core: the engine-core process, the
default; in-process: --engine-in-process), runs the benchmark against it, stops it; `offline` builds the same
engine in this process (the server's own argument parsing and make_engine) and times one LLM-style generate
of the same prompts (every request added at once, stepped to the end). The table gives req/s, each mode's
ratio to offline, and ITL p50 / p99.

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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_run(args, mode: str) -> dict:
    """Starts the server in `mode` (core / in-process), benchmarks it, stops it."""
    import shlex
    import subprocess
    import urllib.request

    port = _free_port()
    cmd = [sys.executable, "-m", "xllm_gen.runtime.serving.server", args.serve, "--port", str(port),
           "--log-level", "warning", *(["--engine-in-process"] if mode == "in-process" else []),
           *shlex.split(args.serve_args)]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + args.serve_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server ({mode}) exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server ({mode}) did not start in {args.serve_timeout} s") from None
                time.sleep(0.25)
        sub = argparse.Namespace(**{**vars(args), "base_url": f"http://127.0.0.1:{port}"})
        return asyncio.run(run(sub))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def offline_run(args) -> dict:
    """The same prompts through the engine in this process, all added at once and stepped to the end (what
    LLM.generate does), after the same warm-up."""
    import shlex

    from xllm_gen.runtime.engine.sampling_params import SamplingParams
    from xllm_gen.runtime.serving.server import _parser, make_engine

    eargs = _parser().parse_args([args.serve, *shlex.split(args.serve_args)])
    engine = make_engine(eargs)
    try:
        prompts = make_prompts(args.num_prompts, args.input_len, args.shared_prefix_len, args.vocab_size, args.seed)

        def generate(ps, n):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for i, p in enumerate(ps):
                engine.add_request(i, {"prompt_token_ids": p}, sp)
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step_outputs()
            return outs

        generate(prompts[:args.warmup], min(args.output_len, 4))
        t0 = time.perf_counter()
        outs = generate(prompts, args.output_len)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": "offline", "num_prompts": len(prompts), "completed": len(outs), "failed": len(prompts) - len(outs),
            "duration_s": wall, "request_throughput": len(outs) / wall, "output_throughput": out_tokens / wall}


def compare_modes(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("core", "in-process", "offline")]
    if bad:
        print(f"error: --modes: unknown {bad} (core, in-process, offline)", file=sys.stderr)
        return 2
    reports = {}
    for m in modes:
        reports[m] = offline_run(args) if m == "offline" else serve_and_run(args, m)
        reports[m]["mode"] = m
        r = reports[m]           # as each mode ends (a timeout later keeps it)
        print(f"[{m}] req/s {r['request_throughput']:.2f}, out tok/s {r['output_throughput']:.1f}, ITL ms "
              f"{r.get('itl_ms', {})}, TTFT ms {r.get('ttft_ms', {})}, failed {r['failed']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "modes": reports}, f, indent=2)
    base = reports.get("offline", {}).get("request_throughput")
    print(f"\n{'mode':11s} {'req/s':>8s} {'x offline':>9s} {'out tok/s':>10s} {'ITL p50':>8s} {'ITL p99':>8s} "
          f"{'p99/p50':>7s} {'TTFT p50':>9s}")
    for m, r in reports.items():
        itl = r.get("itl_ms", {})
        ratio = r["request_throughput"] / base if base else float("nan")
        p50, p99 = itl.get("p50", float("nan")), itl.get("p99", float("nan"))
        print(f"{m:11s} {r['request_throughput']:8.2f} {ratio:9.2f} {r['output_throughput']:10.1f} {p50:8.2f} "
              f"{p99:8.2f} {p99 / p50 if p50 == p50 and p50 else float('nan'):7.2f} "
              f"{r.get('ttft_ms', {}).get('p50', float('nan')):9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "modes": reports}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


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
    ap.add_argument("--serve", metavar="MODEL_DIR", help="start the server on MODEL_DIR per --modes instead of "
                    "using --base-url, and compare the modes")
    ap.add_argument("--modes", default="core,in-process,offline",
                    help="with --serve: core (engine-core process), in-process (--engine-in-process), offline "
                         "(the engine in this process, no HTTP), comma-separated")
    ap.add_argument("--serve-args", default="", help="with --serve: more server arguments (one string)")
    ap.add_argument("--serve-timeout", type=float, default=900.0, help="with --serve: seconds to wait for start-up")
    args = ap.parse_args(argv)
    if args.serve:
        return compare_modes(args)
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
