"""Decode benchmark: TTFT / TPOT of the generated Qwen3 runner (eager and CUDA-graph decode) with random
weights of real model shapes, beside the weight-read floor and a Hugging Face transformers baseline measured
in the same run, plus a throughput mode. Writes a markdown table (and a JSON file beside it).

    python bench/bench_decode.py --out bench/results/h200.md                 # everything (~6-8 min on an H200)
    python bench/bench_decode.py --sections sweep --batch-sizes 1,16,100     # a subset

Sections: floor (device-to-device copy bandwidth), sweep (Qwen3-0.6B, input 1024, output 256, batch sizes
1 2 3 5 7 8 13 16 31 47 100, eager and graph), 8b (Qwen3-8B at batch 1, 16, 64), hf (transformers, static
cache + torch.compile reduce-overhead, batch 1), throughput (256 requests, random input/output lengths
100-1024, graph decode), profile (where a graph decode step's time goes: host parts, GPU replay, top
kernels). Model sizes come from specs/qwen3.yaml `variants` (fallback: the numbers below).

Timing: the engine's step loop is driven here; every step ends in the sampler's device-to-host copy of the
token ids, so a host clock read after a step sees the step's device work finished. Per request: TTFT = first
token time - submit time; TPOT = (finish time - first token time) / (output - 1); medians over requests and
runs. Floors: weight read = parameter bytes / copy bandwidth; "weights+KV" adds the KV cache bytes one decode
step reads at the mean context of the run (input + output/2 tokens per sequence).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

FALLBACK_VARIANTS = {
    "Qwen3-0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=40960, eos_token_id=[151645]),
    "Qwen3-8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1000000.0, max_position_embeddings=40960, eos_token_id=[151645]),
}
SWEEP_BATCHES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 47, 100]
BATCHES_8B = [1, 16, 64]


# ------------------------------------------------------------------------------------------------ setup
def variant(name: str) -> dict:
    try:
        import yaml
        spec = yaml.safe_load((REPO / "specs" / "qwen3.yaml").read_text())
        return dict(spec["variants"][name])
    except Exception:
        return dict(FALLBACK_VARIANTS[name])


def write_config(root: Path, name: str) -> Path:
    v = variant(name)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
           "attention_bias": False, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "bos_token_id": 151643,
           "use_cache": True, **v}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1000000.0)}
    if isinstance(cfg.get("eos_token_id"), list) and len(cfg["eos_token_id"]) == 1:
        cfg["eos_token_id"] = cfg["eos_token_id"][0]
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "flashinfer", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:           # noqa: BLE001
            out[mod] = f"n/a ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    return out


def free_cuda():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ floor
def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of reps)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    free_cuda()
    return 2 * nbytes / statistics.median(times)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())      # tied weights counted once


def kv_bytes_per_token(runner) -> int:
    a = runner.attn_layers[0]
    return 2 * len(runner.attn_layers) * a.num_kv_heads * a.head_dim * torch.tensor([], dtype=runner.dtype).element_size()


# ------------------------------------------------------------------------------------------------ engine
DEBUG: dict = {}          # runner debug switches for every engine of the run (--decode-tensor-cores)


def make_llm(model_dir: Path, *, max_num_seqs: int, max_model_len: int, num_kv_blocks: int, eager: bool = False):
    from xllm_gen import LLM
    t0 = time.perf_counter()
    # prefix caching off: the modes of a row run the same prompts one after another, and a later mode would
    # find them cached (its TTFT would time a 16-token prefill)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, enforce_eager=eager, _debug=dict(DEBUG),
              enable_prefix_caching=False)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def runner_has_fast_path() -> bool:
    import inspect

    from xllm_gen.runtime.executor.model_runner import ModelRunner
    return "graphs.run(" in inspect.getsource(ModelRunner.run)


def set_mode(llm, mode: str, saved: dict):
    """mode: eager (no graphs), graph (the runner as it is: decode graphs and piecewise prefill graphs),
    graph-eager-prefill (decode graphs, eager prefill: the TTFT baseline of prefill graphs), graph-sync (graphs,
    async scheduling off: each decode step's tokens are read before the next step is prepared; the baseline of
    async scheduling), graph-fast (the runner patched to call DecodeGraphs.run(seqs) directly, the patch
    proposed for ModelRunner.run)."""
    runner = llm.engine.runner
    if "graphs" not in saved:
        saved["graphs"] = runner.graphs
        saved["prefill_graphs"] = getattr(runner, "prefill_graphs", None)
        saved["run"] = runner.run
        saved["async"] = getattr(llm.engine, "_async", None)
    if hasattr(llm.engine, "_async"):
        llm.engine._async = None if mode == "graph-sync" else saved["async"]
    runner.graphs = None if mode == "eager" else saved["graphs"]
    if hasattr(runner, "prefill_graphs"):
        runner.prefill_graphs = None if mode in ("eager", "graph-eager-prefill") else saved["prefill_graphs"]
    runner.run = saved["run"]
    if mode == "graph-fast":
        orig = saved["run"]

        def run(seqs, is_prefill, all_rows=False, **kw):
            g = runner.graphs
            if not is_prefill and not all_rows and not kw and g is not None and g.fits(len(seqs)):
                with torch.inference_mode():
                    return runner.model.compute_logits(g.run(seqs)).float()
            return orig(seqs, is_prefill, all_rows, **kw)
        runner.run = run


def drive(llm, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """Submits all requests at once and runs the engine's step loop; per-request TTFT / TPOT (seconds)."""
    from xllm_gen import SamplingParams
    engine = llm.engine
    seqs = [engine.make_sequence(i, {"prompt_token_ids": p},
                                 SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, out_lens))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in seqs:
        engine.scheduler.add(s)
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    waiting_first = len(seqs)
    steps = 0
    while engine.scheduler.has_unfinished():
        finished = engine.step()
        now = time.perf_counter()
        steps += 1
        if waiting_first:
            for s in seqs:
                if s.seq_id not in first and s.num_completion_tokens >= 1:
                    first[s.seq_id] = now
                    waiting_first -= 1
        for s in finished:
            end[s.seq_id] = now
    total = time.perf_counter() - t0
    ttft = [first[s.seq_id] - t0 for s in seqs]
    tpot = [(end[s.seq_id] - first[s.seq_id]) / (n - 1) for s, n in zip(seqs, out_lens) if n > 1]
    return dict(ttft=ttft, tpot=tpot, total=total, steps=steps,
                out_tokens=sum(out_lens), in_tokens=sum(len(p) for p in prompts))


def rand_prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return rng.integers(0, vocab, (n, length)).tolist()


def bench_batch(llm, B: int, in_len: int, out_len: int, runs: int, seed: int) -> dict:
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(seed)
    drive(llm, rand_prompts(rng, vocab, B, in_len), [8] * B)           # warm-up at this batch size
    ttft, tpot, walls, last_first = [], [], [], []
    for _ in range(runs):
        r = drive(llm, rand_prompts(rng, vocab, B, in_len), [out_len] * B)
        ttft += r["ttft"]
        tpot += r["tpot"]
        walls.append(r["total"])
        last_first.append(max(r["ttft"]))        # every prompt prefilled: B x in_len tokens
    return dict(ttft_ms=1e3 * statistics.median(ttft), tpot_ms=1e3 * statistics.median(tpot),
                tpot_min_ms=1e3 * min(tpot), ttft_min_ms=1e3 * min(ttft), runs=runs, wall_s=sum(walls),
                all_prefilled_ms=1e3 * statistics.median(last_first))


def runs_for(B: int) -> int:
    return 3 if B <= 4 else (2 if B <= 16 else 1)


def sweep(model_dir: Path, name: str, batches: list[int], modes: list[str], in_len: int, out_len: int,
          bw: float, log, max_num_seqs: int = 1, max_seq_len: int = 0, min_bs: int = 1) -> dict:
    """Batch-size sweep on one engine. The engine is sized for max(batches) sequences of in_len + out_len
    tokens and, when given, for max_num_seqs sequences of max_seq_len tokens (the throughput mode's)."""
    max_bs = max(list(batches) + [min_bs])
    seq_len = max(in_len + out_len, max_seq_len)
    blocks = max(max_bs * math.ceil((in_len + out_len) / 16), max_num_seqs * math.ceil(max_seq_len / 16)) + 64
    llm, load_s = make_llm(model_dir, max_num_seqs=max(max_bs, max_num_seqs), max_model_len=seq_len + 16,
                           num_kv_blocks=blocks)
    runner = llm.engine.runner
    g = runner.graphs
    pg = getattr(runner, "prefill_graphs", None)
    res = dict(model=name, load_and_capture_s=load_s, capture_s=g.capture_seconds if g else None,
               prefill_capture_s=pg.capture_seconds if pg else None, prefill_buckets=list(pg.sizes) if pg else [],
               buckets=list(g.buckets) if g else [], param_bytes=param_bytes(runner.model),
               kv_bytes_per_token=kv_bytes_per_token(runner), rows=[])
    w_floor = res["param_bytes"] / bw * 1e3
    res["weight_floor_ms"] = w_floor
    log(f"{name}: loaded + captured in {load_s:.1f} s (decode capture {res['capture_s']}, prefill capture "
        f"{res['prefill_capture_s']} for {res['prefill_buckets']}), params "
        f"{res['param_bytes'] / 1e9:.2f} GB, weight-read floor {w_floor:.3f} ms")
    saved: dict = {}
    for B in batches:
        row = dict(batch=B, bucket=g.bucket_for(B) if g and g.fits(B) else None)
        kv = B * (in_len + out_len / 2) * res["kv_bytes_per_token"]
        row["floor_ms"] = (res["param_bytes"] + kv) / bw * 1e3
        for mode in modes:
            set_mode(llm, mode, saved)
            try:
                runs = 1 if mode == "eager" else runs_for(B)
                row[mode] = bench_batch(llm, B, in_len, out_len, runs, seed=B)
            except Exception as e:           # noqa: BLE001  (keep the other results)
                row[mode] = dict(error=f"{type(e).__name__}: {e}")
            log(f"{name} B={B} {mode}: {row[mode]}")
        set_mode(llm, "graph", saved)
        res["rows"].append(row)
    res["_llm"] = llm
    return res


def merge_sweep(old, new: dict) -> dict:
    """With --append, a sweep of some modes / batch sizes updates those cells of an earlier sweep of the same
    model and shapes and keeps the rest (e.g. re-measuring graph decode without re-running eager)."""
    if not old or old.get("model") != new.get("model") or (old.get("in_len"), old.get("out_len")) != \
            (new.get("in_len"), new.get("out_len")):
        return new
    rows = {r["batch"]: r for r in old["rows"]}
    for r in new["rows"]:
        rows.setdefault(r["batch"], {}).update(r)
    merged = dict(old)
    merged.update({k: v for k, v in new.items() if k not in ("rows", "modes")})
    merged["modes"] = list(dict.fromkeys(list(old.get("modes", [])) + list(new.get("modes", []))))
    merged["rows"] = [rows[b] for b in sorted(rows)]
    return merged


def throughput(llm, n: int, lo: int, hi: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = llm.engine.vocab_size
    in_lens = rng.integers(lo, hi + 1, n).tolist()
    out_lens = rng.integers(lo, hi + 1, n).tolist()
    prompts = [rng.integers(0, vocab, L).tolist() for L in in_lens]
    drive(llm, prompts[:32], [4] * 32)                                # warm-up
    r = drive(llm, prompts, out_lens)
    return dict(requests=n, in_tokens=r["in_tokens"], out_tokens=r["out_tokens"], seconds=r["total"],
                steps=r["steps"], out_tok_s=r["out_tokens"] / r["total"],
                total_tok_s=(r["in_tokens"] + r["out_tokens"]) / r["total"],
                preemptions=llm.engine.scheduler.num_preemptions)


# ------------------------------------------------------------------------------------------------ profile
def _ev_ms(fn, reps: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def profile_decode(llm, B: int, in_len: int, steps: int = 60, top: int = 14) -> dict:
    """Where a graph decode step's time goes, at batch B after prefills of in_len tokens: the whole engine
    step (DecodeGraphs.run path), the host part of DecodeGraphs.run before the replay (inputs, copies, plan),
    the graph replay alone on the GPU (back-to-back replays, CUDA events), logits + argmax on the GPU, and
    the top kernels of one replay (torch.profiler)."""
    from xllm_gen import SamplingParams
    engine = llm.engine
    runner = engine.runner
    g = runner.graphs
    rng = np.random.default_rng(B)
    seqs = [engine.make_sequence(i, {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=10 ** 4,
                                                                          ignore_eos=True))
            for i, p in enumerate(rand_prompts(rng, engine.vocab_size, B, in_len))]
    for s in seqs:
        engine.scheduler.add(s)
    res = dict(batch=B, bucket=g.bucket_for(B))
    try:
        while any(s.num_completion_tokens == 0 for s in seqs):
            engine.step()
        for _ in range(5):
            engine.step()
        st = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            st.append(time.perf_counter() - t)
        res["engine_step_ms"] = 1e3 * statistics.median(st)
        running = list(engine.scheduler.running)
        Bk = g.bucket_for(len(running))
        host = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            bs = g.block_size
            lens = [s.num_tokens for s in running]
            tables = [s.block_table for s in running]
            total = g._write_step(len(running), Bk, [s.token_ids[-1] for s in running], [n - 1 for n in lens],
                                  [tb[(n - 1) // bs] * bs + (n - 1) % bs for tb, n in zip(tables, lens)], lens, tables)
            t1 = time.perf_counter()
            g._upload(Bk, total)
            t2 = time.perf_counter()
            g._plan(Bk, total)
            t3 = time.perf_counter()
            g.graphs[Bk].replay()
            t4 = time.perf_counter()
            host.append((t1 - t, t2 - t1, t3 - t2, t4 - t3))
        med = [1e3 * statistics.median(x[i] for x in host) for i in range(4)]
        res.update(host_inputs_ms=med[0], host_copies_ms=med[1], host_plan_ms=med[2], host_replay_launch_ms=med[3])
        res["gpu_replay_ms"] = _ev_ms(g.graphs[Bk].replay, 50)
        hidden = g.outputs[Bk][: len(running)]
        with torch.inference_mode():
            res["gpu_logits_argmax_ms"] = _ev_ms(lambda: runner.model.compute_logits(hidden).float().argmax(-1), 50)
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    g.graphs[Bk].replay()
                torch.cuda.synchronize()
            ka = prof.key_averages()
            key = "device_time_total" if hasattr(ka[0], "device_time_total") else "cuda_time_total"
            rows = sorted(ka, key=lambda e: getattr(e, key), reverse=True)[:top]
            res["kernels"] = [(e.key[:90], e.count // 3, getattr(e, key) / 3 / 1e3) for e in rows]
        except Exception as e:                   # noqa: BLE001
            res["kernels_error"] = f"{type(e).__name__}: {e}"
    finally:
        for q in (engine.scheduler.waiting, engine.scheduler.running):
            while q:
                engine.block_manager.free(q.pop())
    return res


def profile_markdown(P: list, model: str) -> list:
    """The lines of profile_decode's table (one row per batch) and each batch's top kernels."""
    L = [f"## Where a graph decode step goes ({model}, DecodeGraphs.run path)\n",
         "| batch | bucket | engine step ms | host: inputs ms | host: copies ms | host: plan ms | "
         "host: replay launch ms | GPU: replay ms | GPU: logits+argmax ms |",
         "|---|---|---|---|---|---|---|---|---|"]
    for p in P:
        if "engine_step_ms" not in p:
            L.append(f"| {p.get('batch')} | error: {p.get('error')} |")
            continue
        L.append("| " + " | ".join([str(p["batch"]), str(p["bucket"])] + [
            f"{p[k]:.3f}" for k in ("engine_step_ms", "host_inputs_ms", "host_copies_ms", "host_plan_ms",
                                    "host_replay_launch_ms", "gpu_replay_ms", "gpu_logits_argmax_ms")]) + " |")
    for p in P:
        if p.get("kernels"):
            L.append(f"\nTop kernels of one replay at batch {p['batch']} (GPU ms per replay, launches):\n")
            L.append("| kernel | launches | ms |")
            L.append("|---|---|---|")
            L += [f"| `{k}` | {c} | {t:.3f} |" for k, c, t in p["kernels"]]
    return L + [""]


# ------------------------------------------------------------------------------------------------ HF
def hf_baseline(model_dir: Path, in_len: int, out_len: int, log, eager_tokens: int = 32,
                compile: bool = True) -> dict:
    """transformers' generate() at batch 1: eager (dynamic cache), and with `compile` static cache +
    torch.compile (minutes for a large model: compile=False skips it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(str(model_dir))
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    init_s = time.perf_counter() - t0
    ids = torch.randint(0, cfg.vocab_size, (1, in_len), device="cuda")
    mask = torch.ones_like(ids)

    def timed(n_new: int, **kw) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             pad_token_id=0, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == in_len + n_new
        return time.perf_counter() - t

    res = dict(init_s=init_s)
    # eager (dynamic cache, no compile): a few tokens are enough for its TPOT
    t1 = statistics.median(timed(1, disable_compile=True) for _ in range(3))
    tn = statistics.median(timed(eager_tokens, disable_compile=True) for _ in range(2))
    res["eager"] = dict(ttft_ms=1e3 * t1, tpot_ms=1e3 * (tn - t1) / (eager_tokens - 1))
    log(f"HF eager: {res['eager']}")
    if not compile:
        model = None
        free_cuda()
        return res
    # static cache + torch.compile (mode reduce-overhead, the generate() default for a static cache)
    t = time.perf_counter()
    timed(out_len, cache_implementation="static")
    timed(out_len, cache_implementation="static")
    res["compile_and_warmup_s"] = time.perf_counter() - t
    t1 = statistics.median(timed(1, cache_implementation="static") for _ in range(3))
    tn = statistics.median(timed(out_len, cache_implementation="static") for _ in range(3))
    res["static_compile"] = dict(ttft_ms=1e3 * t1, tpot_ms=1e3 * (tn - t1) / (out_len - 1))
    log(f"HF static+compile: {res['static_compile']}")
    model = None                     # release the weights (timed() is not called again)
    free_cuda()
    return res


# ------------------------------------------------------------------------------------------------ report
def fmt(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def cell(row, mode, key):
    r = row.get(mode)
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    return fmt(r[key], 3 if key.startswith("tpot") else 2)


def markdown(R: dict) -> str:
    L = []
    v = R["versions"]
    L.append(f"# Decode benchmark: {v.get('gpu', '?')}\n")
    L.append(f"- command: `{R['command']}`")
    L.append(f"- date: {R['date']}")
    L.append("- versions: " + ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "triton", "flashinfer",
                                                                  "transformers", "python") if k in v))
    if "bandwidth" in R:
        L.append(f"- device-to-device copy bandwidth (read + write, 2 GiB, median of 20): "
                 f"{R['bandwidth'] / 1e12:.2f} TB/s")
    L.append("- random bf16 weights (load_format=dummy), greedy, ignore_eos; TTFT/TPOT medians over requests "
             "and runs; TPOT = (last token - first token) / (output - 1); floors: weights = parameter bytes / "
             "copy bandwidth, weights+KV adds the KV bytes a decode step reads at the run's mean context")
    L.append("")
    for key in ("sweep", "8b"):
        S = R.get(key)
        if not S:
            continue
        modes = S["modes"]
        L.append(f"## {S['model']}: input {S['in_len']}, output {S['out_len']}\n")
        L.append(f"parameters {S['param_bytes'] / 1e9:.3f} GB; weight-read floor {S['weight_floor_ms']:.3f} ms; "
                 f"graph buckets {S['buckets']}; engine start (random init + capture) {S['load_and_capture_s']:.1f} s, "
                 f"capture {fmt(S['capture_s'], 2)} s; prefill graph buckets {S.get('prefill_buckets', [])}, capture "
                 f"{fmt(S.get('prefill_capture_s'), 2)} s\n")
        hdr = ["batch", "bucket"] + [f"TTFT {m} ms" for m in modes] + [f"TPOT {m} ms" for m in modes] + \
              ["floor weights+KV ms", "best graph TPOT / floor"]
        L.append("| " + " | ".join(hdr) + " |")
        L.append("|" + "---|" * len(hdr))
        for row in S["rows"]:
            g = [row[m]["tpot_ms"] for m in modes if m.startswith("graph") and m in row and "tpot_ms" in row[m]]
            ratio = f"{min(g) / row['floor_ms']:.2f}x" if g else "-"
            cells = [str(row["batch"]), fmt(row["bucket"])] + [cell(row, m, "ttft_ms") for m in modes] + \
                    [cell(row, m, "tpot_ms") for m in modes] + [fmt(row["floor_ms"]), ratio]
            L.append("| " + " | ".join(cells) + " |")
        L.append("")
    H = R.get("hf")
    if H:
        L.append("## Hugging Face transformers baseline (Qwen3-0.6B shapes, batch 1, same run)\n")
        L.append("| variant | TTFT ms | TPOT ms |")
        L.append("|---|---|---|")
        for k, label in (("eager", "eager (dynamic cache)"),
                         ("static_compile", "static cache + torch.compile (reduce-overhead)")):
            if k in H:
                L.append(f"| {label} | {H[k]['ttft_ms']:.2f} | {H[k]['tpot_ms']:.3f} |")
        if "compile_and_warmup_s" in H:
            L.append(f"\ncompile + warm-up: {H['compile_and_warmup_s']:.1f} s")
        if "error" in H:
            L.append(f"\nerror: {H['error']}")
        L.append("")
    if R.get("profile"):
        L += profile_markdown(R["profile"], "Qwen3-0.6B")
    T = R.get("throughput")
    if T:
        L.append(f"## Throughput (Qwen3-0.6B, {T.get('mode', 'graph')} decode): {T['requests']} requests at once, "
                 f"input and output lengths uniform in [{T['lo']}, {T['hi']}]\n")
        if "error" in T:
            L.append(f"error: {T['error']}\n")
        else:
            L.append("| requests | input tokens | output tokens | seconds | engine steps | output tok/s | "
                     "total tok/s | preemptions |")
            L.append("|---|---|---|---|---|---|---|---|")
            L.append(f"| {T['requests']} | {T['in_tokens']} | {T['out_tokens']} | {T['seconds']:.2f} | {T['steps']} | "
                     f"{T['out_tok_s']:.0f} | {T['total_tok_s']:.0f} | {T['preemptions']} |\n")
    tg = targets(R)
    if tg:
        L.append("## Targets (issue 5)\n")
        L.append("| target | measured | met |")
        L.append("|---|---|---|")
        L += [f"| {a} | {b} | {c} |" for a, b, c in tg]
        L.append("")
    if R.get("notes"):
        L.append("## Notes\n")
        L += list(R["notes"])
        L.append("")
    if R.get("log"):
        L.append("<details><summary>log</summary>\n\n```\n" + "\n".join(R["log"]) + "\n```\n</details>\n")
    return "\n".join(L)


def _best(row, key):
    vals = [row[m][key] for m in row if m.startswith("graph") and isinstance(row[m], dict) and key in row[m]]
    return min(vals) if vals else None


def targets(R: dict) -> list:
    out = []
    S = R.get("sweep")
    if S:
        rows = {r["batch"]: r for r in S["rows"]}
        if 1 in rows:
            t = _best(rows[1], "tpot_ms")
            if t is not None:
                out.append(("Qwen3-0.6B batch 1 graph TPOT <= 1.3 ms", f"{t:.3f} ms", "yes" if t <= 1.3 else "no"))
            t = _best(rows[1], "ttft_ms")
            if t is not None:
                out.append(("Qwen3-0.6B batch 1 TTFT (1024 tokens) <= 7 ms", f"{t:.2f} ms", "yes" if t <= 7 else "no"))
        if 100 in rows:
            t = _best(rows[100], "tpot_ms")
            if t is not None:
                out.append(("Qwen3-0.6B batch 100 graph TPOT <= 6.5 ms", f"{t:.3f} ms", "yes" if t <= 6.5 else "no"))
        H = R.get("hf", {}).get("static_compile")
        if H and 1 in rows and _best(rows[1], "tpot_ms") is not None:
            t = _best(rows[1], "tpot_ms")
            out.append(("faster than HF static+compile at batch 1 (same run)",
                        f"{t:.3f} vs {H['tpot_ms']:.3f} ms ({H['tpot_ms'] / t:.1f}x)", "yes" if t < H["tpot_ms"] else "no"))
    E = R.get("8b")
    if E:
        rows = {r["batch"]: r for r in E["rows"]}
        if 1 in rows and _best(rows[1], "tpot_ms") is not None:
            t = _best(rows[1], "tpot_ms")
            f = E["weight_floor_ms"]
            out.append(("Qwen3-8B batch 1 TPOT <= 1.25x weight-read floor",
                        f"{t:.3f} ms vs floor {f:.3f} ms ({t / f:.2f}x)", "yes" if t <= 1.25 * f else "no"))
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200.md"), help="markdown output")
    ap.add_argument("--sections", default="floor,sweep,profile,throughput,hf,8b",
                    help="comma list of floor, sweep, profile, throughput, hf, 8b")
    ap.add_argument("--batch-sizes", default=",".join(map(str, SWEEP_BATCHES)))
    ap.add_argument("--batch-sizes-8b", default=",".join(map(str, BATCHES_8B)))
    ap.add_argument("--modes", default="auto",
                    help="comma list of eager, graph, graph-eager-prefill, graph-sync, graph-fast; auto = eager,graph "
                         "(+graph-fast when ModelRunner.run does not call DecodeGraphs.run yet)")
    ap.add_argument("--decode-tensor-cores", choices=["auto", "on", "off"], default="auto",
                    help="FlashInfer decode kernel: auto (the backend's rule), on (tensor-core / prefill kernel), "
                         "off (CUDA-core decode kernel)")
    ap.add_argument("--decode-attention", choices=["auto", "flashinfer", "triton"], default=None,
                    help="decode attention kernel (default: $XLLM_DECODE_ATTENTION, else auto: the Triton split-KV "
                         "kernel for small batches, FlashInfer above)")
    ap.add_argument("--modes-8b", default="graph,eager")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--throughput-requests", type=int, default=256)
    ap.add_argument("--profile-batches", default="1,100")
    ap.add_argument("--throughput-range", default="100,1024")
    ap.add_argument("--workdir", default=None, help="where the config.json dirs go (default: a temp dir)")
    ap.add_argument("--append", action="store_true",
                    help="add this run's sections to the results already in OUT's .json (one table from several "
                         "invocations, e.g. to fit a time limit per command)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only write the markdown of an earlier run's JSON to --out (no GPU needed)")
    args = ap.parse_args(argv)
    if args.render:
        Path(args.out).write_text(markdown(json.loads(Path(args.render).read_text())))
        return 0
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.decode_tensor_cores != "auto":
        DEBUG["decode_tensor_cores"] = args.decode_tensor_cores == "on"
    if args.decode_attention:
        DEBUG["decode_attention"] = args.decode_attention
    modes = (["eager", "graph"] + ([] if runner_has_fast_path() else ["graph-fast"])
             if args.modes == "auto" else [m.strip() for m in args.modes.split(",")])
    lo, hi = (int(x) for x in args.throughput_range.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="xllm_bench_"))
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd())] +
                                   list(argv if argv is not None else sys.argv[1:]))
    R: dict = dict(command=command, date=time.strftime("%Y-%m-%d %H:%M %Z"), versions=versions(), log=[])
    if args.append and out.with_suffix(".json").exists():
        R = json.loads(out.with_suffix(".json").read_text())
        R["command"] = R["command"] + "` then `" + command

    def log(msg):
        print(msg, flush=True)
        R["log"].append(msg)

    def save():
        out.write_text(markdown(R))
        clean = {k: v for k, v in R.items()}
        for k in ("sweep", "8b"):
            if k in clean and clean[k]:
                clean[k] = {kk: vv for kk, vv in clean[k].items() if kk != "_llm"}
        out.with_suffix(".json").write_text(json.dumps(clean, indent=1, default=str))

    log(f"versions: {R['versions']}")
    if "bandwidth" not in R or "floor" in sections:
        R["bandwidth"] = copy_bandwidth()
        log(f"copy bandwidth {R['bandwidth'] / 1e12:.2f} TB/s")
    bw = R["bandwidth"]
    save()
    llm06 = None
    d06 = write_config(root, "Qwen3-0.6B")
    if "sweep" in sections or "throughput" in sections or "profile" in sections:
        batches = [int(b) for b in args.batch_sizes.split(",")] if "sweep" in sections else []
        if "profile" in sections:
            batches_p = [int(b) for b in args.profile_batches.split(",")]
        else:
            batches_p = []
        t = time.perf_counter()
        tp = "throughput" in sections
        S = sweep(d06, "Qwen3-0.6B", batches if "sweep" in sections else [], modes if "sweep" in sections else [],
                  args.input_len, args.output_len, bw, log,
                  max_num_seqs=args.throughput_requests if tp else 1, max_seq_len=2 * hi if tp else 0,
                  min_bs=max(batches_p + [1]))
        S.update(modes=modes, in_len=args.input_len, out_len=args.output_len)
        llm06 = S.pop("_llm")
        if "sweep" in sections:
            R["sweep"] = merge_sweep(R.get("sweep"), S)
        log(f"sweep: {time.perf_counter() - t:.1f} s")
        save()
        if "profile" in sections:
            set_mode(llm06, "graph-fast", {})
            R["profile"] = []
            for B in [int(b) for b in args.profile_batches.split(",")]:
                try:
                    R["profile"].append(profile_decode(llm06, B, args.input_len))
                except Exception as e:           # noqa: BLE001
                    R["profile"].append(dict(batch=B, error=f"{type(e).__name__}: {e}"))
                log(f"profile: {R['profile'][-1]}")
            save()
        if "throughput" in sections:
            t = time.perf_counter()
            tmode = "graph" if runner_has_fast_path() else "graph-fast"
            set_mode(llm06, tmode, {})
            try:
                T = throughput(llm06, args.throughput_requests, lo, hi)
                T["mode"] = tmode
            except Exception as e:               # noqa: BLE001
                T = dict(requests=args.throughput_requests, error=f"{type(e).__name__}: {e}")
            T.update(lo=lo, hi=hi)
            R["throughput"] = T
            log(f"throughput: {T} ({time.perf_counter() - t:.1f} s)")
            save()
        llm06.shutdown()
        del llm06, S
        free_cuda()
    if "hf" in sections:
        t = time.perf_counter()
        try:
            R["hf"] = hf_baseline(d06, args.input_len, args.output_len, log)
        except Exception as e:                   # noqa: BLE001
            R["hf"] = dict(error=f"{type(e).__name__}: {e}")
            log(f"HF baseline failed: {R['hf']['error']}")
        log(f"hf: {time.perf_counter() - t:.1f} s")
        free_cuda()
        save()
    if "8b" in sections:
        t = time.perf_counter()
        d8 = write_config(root, "Qwen3-8B")
        b8 = [int(b) for b in args.batch_sizes_8b.split(",")]
        m8 = [m.strip() for m in args.modes_8b.split(",")]
        E = sweep(d8, "Qwen3-8B", b8, m8, args.input_len, args.output_len, bw, log)
        E.update(modes=m8, in_len=args.input_len, out_len=args.output_len)
        llm8 = E.pop("_llm")
        R["8b"] = merge_sweep(R.get("8b"), E)
        llm8.shutdown()
        del llm8
        free_cuda()
        log(f"8b: {time.perf_counter() - t:.1f} s")
        save()
    save()
    print(markdown(R).split("<details>")[0])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO)) if str(REPO) not in sys.path else None
    sys.exit(main())
