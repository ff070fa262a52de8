"""AsyncEngine: the LLMEngine stepping in its own thread beside an asyncio loop.

Every engine call happens in the engine thread (the engine is not thread-safe): the event loop sends
commands (add, abort) through a queue and awaits admission through a future; the thread runs
`engine.step_deltas()` while requests are unfinished and hands each step's deltas to the loop in one
`call_soon_threadsafe`. The event loop never waits on a step."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from xllm_gen.runtime.engine.outputs import RequestOutput

logger = logging.getLogger("xllm_gen.serving")


class QueueFullError(Exception):
    pass


@dataclass
class _Track:
    queue: asyncio.Queue
    arrival: float
    first: Optional[float] = None
    last: Optional[float] = None
    tokens: int = 0
    prompt_tokens_counted: bool = False
    done: bool = False


class AsyncEngine:
    def __init__(self, engine, metrics=None, max_queue: int = 256, stats_interval: float = 10.0):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue          # requests beyond the running batch that may wait
        self.max_active = getattr(getattr(engine, "scheduler", None), "max_num_seqs", 256) + max_queue
        self._cmds: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._tracks: dict[Any, _Track] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None     # set when the engine thread died
        self.stats_interval = stats_interval           # seconds between stats log lines while busy (0: none)
        self._last_stats = time.monotonic()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="xllm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left, stops the thread, shuts the engine down (TP ranks too)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.engine.abort_all()
        except Exception:
            pass
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_active(self) -> int:
        return len(self._tracks)

    # ---- commands from the event loop -------------------------------------------------------------
    async def add(self, request_id: Any, prompt: Any, params) -> asyncio.Queue:
        """Admits a request; returns the queue its deltas arrive on (a RequestOutput per step, or an
        Exception when the engine failed). Raises ValueError (bad request) or QueueFullError."""
        if not self.alive:
            raise RuntimeError("the engine is not running")
        if len(self._tracks) >= self.max_active:
            raise QueueFullError(f"too many requests in flight ({len(self._tracks)}); retry later")
        track = _Track(asyncio.Queue(), time.monotonic())
        self._tracks[request_id] = track
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.append(("add", request_id, prompt, params, fut, track.arrival))
        self._wake.set()
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            self._tracks.pop(request_id, None)
            if not fut.done() or fut.cancelled():
                self.abort(request_id)
            raise
        return track.queue

    def abort(self, request_id: Any) -> None:
        """Drops a request (its blocks are freed in the engine thread); safe for finished or unknown ids."""
        track = self._tracks.pop(request_id, None)
        if track is not None and not track.done and self.metrics is not None:
            self.metrics.labels(self.metrics.success, finished_reason="abort").inc()
        self._cmds.append(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._drain()
                if not engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outs = engine.step_deltas()
                except Exception as e:          # a failing step fails the requests in flight, not the server
                    logger.exception("engine step failed; failing the requests in flight")
                    ids = engine.abort_all()
                    self._post([(rid, e) for rid in ids])
                    continue
                self._account(outs)
                self._post([(o.request_id, o) for o in outs])
                self._log_stats()
        except BaseException as e:           # noqa: BLE001 - reported through /health
            logger.exception("engine thread died")
            self.error = e
            self._post([(rid, e) for rid in list(self._tracks)])

    def _log_stats(self) -> None:
        now = time.monotonic()
        if self.metrics is None or not self.stats_interval or now - self._last_stats < self.stats_interval:
            return
        self._last_stats = now
        try:
            logger.info("stats: %s", self.metrics.stats_line())
        except Exception:                     # a log line never fails the engine
            logger.debug("stats line failed", exc_info=True)

    def _drain(self) -> None:
        engine = self.engine
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "add":
                _, rid, prompt, params, fut, arrival = cmd
                if fut.cancelled():
                    continue
                try:
                    engine.add_request(rid, prompt, params, arrival_time=arrival)
                except BaseException as e:
                    fut.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                    continue
                if not fut.set_running_or_notify_cancel():
                    engine.abort_request(rid)
                    continue
                fut.set_result(None)
                if rid not in self._tracks:          # aborted while it was being admitted
                    engine.abort_request(rid)
            elif cmd[0] == "abort":
                engine.abort_request(cmd[1])
        if self.metrics is not None:
            self.metrics.on_step(engine, 0)

    def _account(self, outs: list[RequestOutput], stats: Optional[dict] = None) -> None:
        """Per-request latencies and token counts of one step's deltas; `stats`: the engine's gauges
        (metrics.engine_stats) when the engine is in another process (None: read from self.engine)."""
        m = self.metrics
        now = time.monotonic()
        new_tokens = 0
        for out in outs:
            track = self._tracks.get(out.request_id)
            n = sum(len(c.token_ids) for c in out.outputs)
            new_tokens += n
            if track is None or m is None:
                continue
            if not track.prompt_tokens_counted:
                track.prompt_tokens_counted = True
                m.labels(m.prompt_tokens).inc(len(out.prompt_token_ids))
            if n:
                if track.first is None:
                    track.first = now
                    m.labels(m.ttft).observe(now - track.arrival)
                else:
                    m.labels(m.itl).observe(now - track.last)
                track.last = now
                track.tokens += n
            if out.finished:
                track.done = True
                m.labels(m.e2e).observe(now - track.arrival)
                if track.first is not None and track.tokens > 1:
                    m.labels(m.tpot).observe((now - track.first) / (track.tokens - 1))
                reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
                reason = "error" if out.error else (reasons.pop() if len(reasons) == 1 else "stop")
                m.labels(m.success, finished_reason=reason).inc()
        if m is not None:
            m.on_step(self.engine, new_tokens) if stats is None else m.on_stats(stats, new_tokens)

    def _post(self, items: list) -> None:
        if items and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:          # the loop is closed: shutting down
                pass

    def _deliver(self, items: list) -> None:          # on the event loop
        for rid, item in items:
            track = self._tracks.get(rid)
            if track is None:
                continue
            track.queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                self._tracks.pop(rid, None)
