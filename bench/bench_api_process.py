"""The API process alone, on the CPU (issue 23, item 4): a fake engine that steps at a fixed interval drives the real
server (FastAPI app, CoreClient / engine-core ZeroMQ protocol, detokenization, SSE), and bench/bench_serve.py's
client measures it, so that the serving layouts' own costs show without a GPU.

    python bench/bench_api_process.py --layouts core,core2,in-process,ideal \
        [--step-ms 7 --num-prompts 256 --max-concurrency 64 --input-len 1024 --output-len 129] [--json out.json]
        [--profile DIR]   # py-spy (if installed) samples the API process (GIL holder): DIR/<layout>.txt

Layouts: core (the default: engine-core process, one API process), core2 (--api-server-count 2), in-process
(--engine-in-process), ideal (the fake engine stepped here without HTTP: the step cadence the server could reach).

The seam is the engine object: `FakeEngine` has what the engine core (runtime/serving/engine_core.py) and the
in-process AsyncEngine call of an LLMEngine (add_request, abort_request, abort_all, step_deltas, scheduler /
block_manager gauges, tokenizer, ...), so the ZeroMQ protocol, pickling, the API process's receiver thread and its
detokenization all run as served. Its step_deltas sleeps to the next step boundary (--step-ms; the GPU's time, GIL
released), spends --step-cpu-ms holding the GIL (the engine's host work), then returns one token for every running
request (at most --max-num-seqs; the others wait), a RequestOutput delta shaped as LLMEngine.step_deltas' (prompt
token ids in every delta; text detokenized incrementally when the engine detokenizes, i.e. in-process). Token ids are
the embedded tiny checkpoint's tokenizer's ids of English text (xllm_gen/default_model.py), so detokenization is
real. The server runs as `python bench/bench_api_process.py --_serve SERVER-ARGS` (server.main with make_engine
replaced, the core process started as `--_core`), configured by XLLM_FAKE_* environment variables.

Reported per layout: req/s and its ratio to the ideal, ITL p50 / p99 (ms), TTFT p50, and the API processes' CPU
time per streamed token (µs; the machine's other load does not inflate it as much as wall time), and the client's
(this process: bench_serve's httpx client parses every chunk; on a small machine it competes with the server)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))


# ------------------------------------------------------------------------------------------- the fake engine
class FakeEngine:
    """An LLMEngine stand-in stepping at a fixed interval (see the module docstring)."""

    def __init__(self, model_dir: str, step_ms: float = 7.0, step_cpu_ms: float = 0.0, max_num_seqs: int = 256):
        from xllm_gen.default_model import _CORPUS
        from xllm_gen.runtime.loading.checkpoint_files import load_tokenizer

        self.model_dir = self.tokenizer_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, required=True)
        self.hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.mm_processor = None
        self.max_model_len = 8192
        self.vocab_size = self.hf_config["vocab_size"]
        self.eos_token_ids = {self.hf_config.get("eos_token_id", 0)}
        self.device, self.dtype = "cpu", "float32"
        self.default_sampling = {}
        self.detokenize = True
        self.runner = None
        self.spec = None
        self.stats = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0, max_num_seqs=max_num_seqs)
        self.block_manager = SimpleNamespace(num_blocks=4096, num_free_blocks=4096, block_size=16)
        self.text_ids = self.tokenizer.encode(_CORPUS, add_special_tokens=False)
        self.step_s, self.cpu_s = step_ms / 1e3, step_cpu_ms / 1e3
        self._reqs: dict = {}
        self._next = None
        self._k = 0

    @property
    def structured(self):
        raise ValueError("the fake engine has no structured outputs")

    def add_request(self, rid, prompt, params, arrival_time=None):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if ids is None:
            ids = self.tokenizer.encode(text or "")
        from xllm_gen.runtime.engine.detokenize import IncrementalDetokenizer

        self._k += 1
        r = SimpleNamespace(rid=rid, prompt=text, ids=list(ids), params=params, out=[[] for _ in range(params.n)],
                            sent=[0] * params.n, start=(self._k * 37) % len(self.text_ids),
                            detok=[IncrementalDetokenizer(self.tokenizer) for _ in range(params.n)])
        self._reqs[rid] = r
        self.scheduler.waiting.append(r)

    def abort_request(self, rid) -> bool:
        r = self._reqs.pop(rid, None)
        if r is None:
            return False
        for q in (self.scheduler.running, self.scheduler.waiting):
            if r in q:
                q.remove(r)
        return True

    def abort_all(self) -> list:
        ids = list(self._reqs)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def shutdown(self) -> None:
        pass

    def step_deltas(self) -> list:
        from xllm_gen.runtime.engine.outputs import CompletionOutput, RequestOutput

        now = time.perf_counter()
        if self._next is None or now > self._next + self.step_s:      # idle, or fell behind: a fresh cadence
            self._next = now
        time.sleep(max(0.0, self._next - now))                        # the GPU's step (GIL released)
        self._next += self.step_s
        if self.cpu_s:                                                # the engine's host work (GIL held)
            end = time.perf_counter() + self.cpu_s
            while time.perf_counter() < end:
                pass
        s = self.scheduler
        while s.waiting and len(s.running) < s.max_num_seqs:
            s.running.append(s.waiting.pop(0))
        outs = []
        for r in list(s.running):
            comps = []
            for i in range(r.params.n):
                tok = self.text_ids[(r.start + 7 * i + len(r.out[i])) % len(self.text_ids)]
                r.out[i].append(tok)
                done = len(r.out[i]) >= r.params.max_tokens
                text = ""
                if self.detokenize:
                    d = r.detok[i]
                    old = len(d.text)
                    d.step(r.out[i])
                    if done:
                        d.flush(r.out[i])
                    text = d.text[old:]
                comps.append(CompletionOutput(i, text, [tok], "length" if done else None, None, None, None))
            done = all(len(o) >= r.params.max_tokens for o in r.out)
            outs.append(RequestOutput(r.rid, r.prompt, r.ids[:], comps, done, None, None, 0))
            if done:
                s.running.remove(r)
                self._reqs.pop(r.rid, None)
        return outs


def _fake_from_env(args=None) -> FakeEngine:
    e = os.environ
    return FakeEngine(e["XLLM_FAKE_MODEL"], float(e.get("XLLM_FAKE_STEP_MS", 7)), float(e.get("XLLM_FAKE_CPU_MS", 0)),
                      int(e.get("XLLM_FAKE_MAX_SEQS", 256)))


def _serve(argv: list) -> int:
    """server.main with the fake engine; the engine-core process it starts runs `--_core` (the fake engine too)."""
    from xllm_gen.runtime.serving import core_client, server

    server.make_engine = _fake_from_env
    real = subprocess.Popen

    def popen(cmd, *a, **kw):
        if cmd[1:3] == ["-m", "xllm_gen.runtime.serving.engine_core"]:
            cmd = [sys.executable, str(HERE), "--_core", *cmd[3:]]
        return real(cmd, *a, **kw)

    core_client.subprocess = SimpleNamespace(Popen=popen, PIPE=subprocess.PIPE)
    return server.main(argv)


def _core(argv: list) -> int:
    from xllm_gen.runtime.serving import engine_core, server

    server.make_engine = _fake_from_env
    sys.argv = [sys.argv[0], *argv]
    return engine_core.main()


# ------------------------------------------------------------------------------------------- measuring
def _cpu_of(pids: list) -> float:
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            pass
    return total


def _api_pids(root: int) -> list:
    """The API processes: the server and its children that run the server module (not the core)."""
    pids = [root]
    try:
        kids = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    except OSError:
        kids = []
    for k in kids:
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"xllm_gen.runtime.serving.server" in cmd:
            pids.append(int(k))
    return pids


def run_layout(args, layout: str) -> dict:
    import urllib.request

    import bench_serve

    from xllm_gen.runtime.cli import default_checkpoint

    model = str(default_checkpoint())
    port = bench_serve._free_port()
    extra = {"core": [], "core2": ["--api-server-count", "2"], "in-process": ["--engine-in-process"]}[layout]
    cmd = [sys.executable, str(HERE), "--_serve", model, "--port", str(port), "--log-level", "warning",
           "--disable-log-requests", "--max-num-seqs", str(args.max_num_seqs), *extra, *shlex.split(args.serve_args)]
    env = {**os.environ, "XLLM_FAKE_MODEL": model, "XLLM_FAKE_STEP_MS": str(args.step_ms),
           "XLLM_FAKE_CPU_MS": str(args.step_cpu_ms), "XLLM_FAKE_MAX_SEQS": str(args.max_num_seqs)}
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env)
    spy = None
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server ({layout}) exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server ({layout}) did not start") from None
                time.sleep(0.25)
        time.sleep(1.0)                     # the other API processes (core2) are up by now
        pids = _api_pids(proc.pid)
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--threads", "--gil", "--format", "raw",
                                    "--rate", "200", "-o", f"{args.profile}/{layout}.txt"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        sub = argparse.Namespace(base_url=f"http://127.0.0.1:{port}", model=None, num_prompts=args.num_prompts,
                                 request_rate=float("inf"), max_concurrency=args.max_concurrency,
                                 input_len=args.input_len, output_len=args.output_len, shared_prefix_len=0,
                                 vocab_size=400, warmup=2, seed=0, timeout=600.0)
        cpu0, own0 = _cpu_of(pids), time.process_time()
        report = asyncio.run(bench_serve.run(sub))
        cpu, own = _cpu_of(pids) - cpu0, time.process_time() - own0
        tokens = report["output_throughput"] * report["duration_s"]
        report["client_cpu_us_per_token"] = own / max(1.0, tokens) * 1e6
        report["api_processes"] = len(pids)
        report["api_cpu_us_per_token"] = cpu / max(1.0, tokens) * 1e6
        return report
    finally:
        if spy is not None:
            spy.send_signal(2)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_ideal(args) -> dict:
    """The fake engine stepped here, every request of a wave of --max-concurrency added at once (no HTTP)."""
    from xllm_gen.runtime.cli import default_checkpoint
    from xllm_gen.runtime.engine.sampling_params import SamplingParams

    eng = FakeEngine(str(default_checkpoint()), args.step_ms, args.step_cpu_ms, args.max_num_seqs)
    eng.detokenize = False
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    done, pending = 0, list(range(args.num_prompts))
    t0 = time.perf_counter()
    live = 0
    while pending or eng.has_unfinished_requests():
        while pending and live < args.max_concurrency:
            eng.add_request(pending.pop(0), {"prompt_token_ids": [1] * args.input_len}, sp)
            live += 1
        for o in eng.step_deltas():
            if o.finished:
                done += 1
                live -= 1
    wall = time.perf_counter() - t0
    return {"request_throughput": done / wall, "output_throughput": done * args.output_len / wall,
            "duration_s": wall, "failed": 0}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_serve"]:
        return _serve(argv[1:])
    if argv[:1] == ["--_core"]:
        return _core(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="core,core2,in-process,ideal")
    ap.add_argument("--step-ms", type=float, default=7.0, help="the fake engine's step interval")
    ap.add_argument("--step-cpu-ms", type=float, default=0.0, help="host work per step, GIL held")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=129)
    ap.add_argument("--serve-args", default="", help="more server arguments (one string)")
    ap.add_argument("--profile", metavar="DIR", help="py-spy record the API process of each layout into DIR")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reports = {}
    for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
        reports[layout] = run_ideal(args) if layout == "ideal" else run_layout(args, layout)
        r = reports[layout]
        print(f"[{layout}] req/s {r['request_throughput']:.2f}, ITL ms {r.get('itl_ms')}, "
              f"API CPU us/token {r.get('api_cpu_us_per_token', float('nan')):.1f}, failed {r['failed']}", flush=True)
    ideal = reports.get("ideal", {}).get("request_throughput") or \
        args.max_concurrency / (args.output_len * args.step_ms / 1e3)
    print(f"\n{'layout':11s} {'req/s':>7s} {'x ideal':>7s} {'ITL p50':>8s} {'ITL p99':>8s} {'p99/p50':>7s} "
          f"{'TTFT p50':>8s} {'API us/tok':>10s} {'client us/tok':>13s}")
    for m, r in reports.items():
        itl = r.get("itl_ms", {})
        p50, p99 = itl.get("p50", float("nan")), itl.get("p99", float("nan"))
        print(f"{m:11s} {r['request_throughput']:7.2f} {r['request_throughput'] / ideal:7.2f} {p50:8.2f} {p99:8.2f} "
              f"{p99 / p50 if p50 == p50 and p50 else float('nan'):7.2f} "
              f"{r.get('ttft_ms', {}).get('p50', float('nan')):8.2f} {r.get('api_cpu_us_per_token', float('nan')):10.1f} "
              f"{r.get('client_cpu_us_per_token', float('nan')):13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "layouts": reports}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
