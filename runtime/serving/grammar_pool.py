"""The API process's grammar compiles (a request's structured-outputs constraint, compiled before admission so that
a bad one is a 400): on their own few threads, never in asyncio's default pool (which renders chat templates:
slow compiles there froze every chat request), under a time limit.

A compile cannot be interrupted (xgrammar's C++), so the limit bounds the request, not the work: past it the
request is a 400 naming its field, the compile finishes in the background (its result is cached) and a request
for the same constraint meanwhile waits on that compile instead of starting another. The threads are daemons: a
compile still running never holds up the server's exit. What bounds the work itself is refused before any compile
(runtime/engine/regex_limits.py: counted repetitions, string lengths, nesting)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from typing import Optional

DEFAULT_TIMEOUT_S = float(os.environ.get("XLLM_GRAMMAR_COMPILE_TIMEOUT_S", "30"))


class CompileTimeout(Exception):
    """A compile that did not finish (`started`; else it did not start: every worker busy) within the limit."""

    def __init__(self, message: str, started: bool):
        super().__init__(message)
        self.started = started


class GrammarPool:
    def __init__(self, workers: int = 2, timeout_s: Optional[float] = None):
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: dict = {}                  # constraint key -> its compile's future
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"xllm-grammar-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            fut, fn, args, key = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:          # noqa: BLE001 - handed to the waiting request
                    fut.set_exception(e)
            with self._lock:
                if self._inflight.get(key) is fut:
                    del self._inflight[key]

    def _submit(self, key, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            fut = self._inflight.get(key) if key is not None else None
            if fut is None:
                fut = concurrent.futures.Future()
                if key is not None:
                    self._inflight[key] = fut
                self._jobs.put((fut, fn, args, key))
        return fut

    async def compile(self, backend, so, where: str):
        """backend.compile(so, where) on a pool thread; CompileTimeout past the limit (the compile goes on)."""
        key = so.key() if not so.problems(where) else None
        fut = self._submit(key, backend.compile, so, where)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            started = fut.running() or fut.done()
            if not started:
                raise CompileTimeout(f"{where}: the grammar compilers stayed busy with other requests' constraints "
                                     f"for {self.timeout_s:g} s; retry later", False) from None
            raise CompileTimeout(f"{where}: the constraint did not compile within {self.timeout_s:g} s; simplify it "
                                 "(fewer or smaller counted repetitions, a smaller schema or grammar)", True) from None
