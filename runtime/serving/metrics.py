"""Prometheus metrics of one server (own registry, so several servers can live in one process). Names
follow vLLM's (`vllm:` prefix replaced by `xllm:`)."""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
_TOKEN_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self._children: dict = {}                # id(metric) -> its child of this model name
        self.model_name = model_name
        self.running = Gauge("xllm:num_requests_running", "Requests in the running batch", lab, registry=r)
        self.waiting = Gauge("xllm:num_requests_waiting", "Requests waiting for KV blocks or a batch slot", lab,
                             registry=r)
        self.kv_usage = Gauge("xllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", lab, registry=r)
        self.prefix_hit_rate = Gauge("xllm:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
                                     "prompt tokens looked up", lab, registry=r)
        self.prefix_queries = Counter("xllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lab, registry=r)
        self.prefix_hits = Counter("xllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lab,
                                   registry=r)
        self.spec_draft_tokens = Counter("xllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified",
                                         lab, registry=r)
        self.spec_accepted_tokens = Counter("xllm:spec_decode_num_accepted_tokens",
                                            "Speculative draft tokens accepted", lab, registry=r)
        self.spec_acceptance = Gauge("xllm:spec_decode_draft_acceptance_rate", "Accepted / verified speculative "
                                     "draft tokens since start", lab, registry=r)
        self.preemptions = Counter("xllm:num_preemptions", "Requests preempted (recomputed later)", lab, registry=r)
        self.prompt_tokens = Counter("xllm:prompt_tokens", "Prompt tokens admitted", lab, registry=r)
        self.generation_tokens = Counter("xllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.tokens_per_s = Gauge("xllm:generation_tokens_per_second", "Tokens generated per second (last 10 s)",
                                  lab, registry=r)
        self.success = Counter("xllm:request_success", "Finished requests by finish reason", lab + ["finished_reason"],
                               registry=r)
        self.rejected = Counter("xllm:request_rejected", "Requests refused (bad request or full queue)",
                                lab + ["reason"], registry=r)
        self.ttft = Histogram("xllm:time_to_first_token_seconds", "Time to first token", lab, buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("xllm:time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request", lab, buckets=_TOKEN_LATENCY, registry=r)
        self.itl = Histogram("xllm:inter_token_latency_seconds", "Time between consecutive tokens", lab,
                             buckets=_TOKEN_LATENCY, registry=r)
        self.e2e = Histogram("xllm:e2e_request_latency_seconds", "Request latency, arrival to last token", lab,
                             buckets=_LATENCY, registry=r)
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_hit_rate, self.prefix_queries,
                       self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens,
                       self.tokens_per_s, self.ttft, self.tpot, self.itl, self.e2e):
            self.labels(metric)              # exported (as 0) from the start
        self._window: collections.deque = collections.deque()     # (time, tokens) of the last 10 s
        self._window_tokens = 0                                    # their sum (kept, not summed each step)
        self._last_preemptions = 0
        self._last_hits = (0, 0)
        self._last_spec = (0, 0)
        self.speculative = False             # a speculating engine: the stats line shows the acceptance rate

    def labels(self, metric, **kw):
        if kw:
            return metric.labels(model_name=self.model_name, **kw)
        child = self._children.get(id(metric))          # the per-token path: no label lookup each time
        if child is None:
            child = self._children[id(metric)] = metric.labels(model_name=self.model_name)
        return child

    def on_step(self, engine, new_tokens: int) -> None:
        """Gauges and counters after one engine step (engine thread)."""
        self.on_stats(engine_stats(engine), new_tokens)

    def on_stats(self, st: dict, new_tokens: int) -> None:
        """Gauges and counters from an engine_stats() snapshot (taken in this process or the engine core's)."""
        self.labels(self.running).set(st["running"])
        self.labels(self.waiting).set(st["waiting"])
        self.labels(self.kv_usage).set(st["used_blocks"] / max(1, st["num_blocks"]))
        d = st["preemptions"] - self._last_preemptions
        if d > 0:
            self.labels(self.preemptions).inc(d)
        self._last_preemptions = st["preemptions"]
        hits, queries = st["prefix_hits"], st["prefix_queries"]
        dh, dq = hits - self._last_hits[0], queries - self._last_hits[1]
        if dq > 0:
            self.labels(self.prefix_queries).inc(dq)
            self.labels(self.prefix_hits).inc(max(0, dh))
        self._last_hits = (hits, queries)
        if queries:
            self.labels(self.prefix_hit_rate).set(hits / queries)
        if st.get("speculative"):
            self.speculative = True
            drafted, accepted = st.get("spec_draft_tokens", 0), st.get("spec_accepted_tokens", 0)
            if drafted > self._last_spec[0]:
                self.labels(self.spec_draft_tokens).inc(drafted - self._last_spec[0])
                self.labels(self.spec_accepted_tokens).inc(max(0, accepted - self._last_spec[1]))
                self.labels(self.spec_acceptance).set(accepted / drafted)
            self._last_spec = (drafted, accepted)
        now = time.monotonic()
        if new_tokens:
            self.labels(self.generation_tokens).inc(new_tokens)
            self._window.append((now, new_tokens))
            self._window_tokens += new_tokens
        while self._window and self._window[0][0] < now - 10.0:
            self._window_tokens -= self._window.popleft()[1]
        span = (now - self._window[0][0]) if len(self._window) > 1 else 0.0
        self.labels(self.tokens_per_s).set(self._window_tokens / span if span > 0 else 0.0)

    def stats_line(self) -> str:
        """running, waiting, KV usage and generation tokens/s (the periodic log line, like vLLM's)."""
        val = lambda m: m.labels(model_name=self.model_name)._value.get()       # noqa: E731
        return (f"running {int(val(self.running))}, waiting {int(val(self.waiting))}, KV usage "
                f"{100 * val(self.kv_usage):.1f}%, generation {val(self.tokens_per_s):.1f} tokens/s, "
                f"prefix-cache hit rate {100 * val(self.prefix_hit_rate):.1f}%"
                + (f", draft acceptance rate {100 * val(self.spec_acceptance):.1f}%" if self.speculative else ""))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_stats(engine) -> dict:
    """What the metrics read from an engine after a step (small and picklable: the engine-core process sends it
    with each step's outputs)."""
    sched, bm = engine.scheduler, engine.block_manager
    stats = getattr(engine, "stats", None) or {}
    used = getattr(bm, "num_used_blocks", None)
    used = used if used is not None else bm.num_blocks - bm.num_free_blocks
    return {"running": len(sched.running), "waiting": len(sched.waiting), "used_blocks": used,
            "num_blocks": bm.num_blocks, "preemptions": sched.num_preemptions,
            "prefix_hits": getattr(bm, "prefix_hits", 0), "prefix_queries": getattr(bm, "prefix_queries", 0),
            "speculative": getattr(engine, "spec", None) is not None,
            "spec_draft_tokens": stats.get("spec_draft_tokens", 0),
            "spec_accepted_tokens": stats.get("spec_accepted_tokens", 0)}
