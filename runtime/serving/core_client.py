"""The API process's side of the engine-core process (runtime/serving/engine_core.py).

`CoreClient` has AsyncEngine's interface (start, stop, add, abort, alive, error, num_active, engine), so the
FastAPI app is the same in both layouts; `CoreFrontend` is its `engine`: what the app reads of an engine
(tokenizer, multimodal processor, structured-outputs compiler for 400s, max_model_len, model_dir,
decode_text), built in this process from the core's "ready" message.

A receiver thread reads the core's messages: it resolves admissions, detokenizes each delta's new token ids
(per completion, incrementally, safe for multi-byte characters) and names the logprob tokens, accounts
metrics from the core's gauges, and hands the deltas to the event loop in one call_soon_threadsafe per step. The
core sends a request's prompt (ids and text) with its first delta only: the receiver puts it back on the later ones."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from xllm_gen.runtime.serving.async_engine import AsyncEngine, QueueFullError, _Track

logger = logging.getLogger("xllm_gen.serving")


class CoreFrontend:
    """The engine as the API process sees it."""

    def __init__(self, info: dict):
        from xllm_gen.runtime.loading.checkpoint_files import load_tokenizer

        self.info = info
        self.model_dir = Path(info["model_dir"])
        self.tokenizer_dir = Path(info["tokenizer_dir"])
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.eos_token_ids = set(info["eos_token_ids"])
        self.default_sampling = info["default_sampling"]
        self.device, self.dtype = info["device"], info["dtype"]
        self.tokenizer = load_tokenizer(self.tokenizer_dir, required=True) if info["has_tokenizer"] else None
        self.mm_processor = None
        if info["multimodal"]:
            from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
            self.mm_processor = MultiModalProcessor(str(self.model_dir), info["hf_config"])
        self._grammar_backend = None
        self._lock = threading.Lock()

    @property
    def structured(self):
        """A grammar compiler of the same tokenizer (cached): the server compiles a request's constraint here
        first, so that an invalid one is a 400 before admission; the core compiles its own for the masks."""
        with self._lock:
            if self._grammar_backend is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs a tokenizer; this checkpoint has none")
                from xllm_gen.runtime.engine.structured_outputs import GrammarBackend
                self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_backend

    def decode_text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class _RequestDetok:
    """The text of one request's completions, from the token ids of its deltas."""

    def __init__(self, tokenizer, params, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.skip = getattr(params, "skip_special_tokens", True)
        self.core_text = bool(getattr(params, "stop", None))      # stop strings: the core detokenizes
        self.completions: dict = {}
        self.prompt = self.prompt_ids = None      # from the first delta (the core sends the prompt once)
        # the tokens whose text a completion they end leaves out (the engine's rule: EOS, stop_token_ids)
        self.stop_ids = set() if getattr(params, "include_stop_str_in_output", False) else \
            set(getattr(params, "stop_token_ids", None) or ()) | \
            (set() if getattr(params, "ignore_eos", False) else set(eos_token_ids or ()))

    def __call__(self, out) -> None:
        from xllm_gen.runtime.engine.engine import IncrementalDetokenizer

        tok = self.tokenizer
        if tok is None:
            return
        for c in out.outputs:
            if not self.core_text:
                d, ids = self.completions.setdefault(c.index, (IncrementalDetokenizer(tok, self.skip), []))
                ids.extend(c.token_ids)
                old = len(d.text)
                text_ids = ids[:-1] if c.finish_reason == "stop" and ids and ids[-1] in self.stop_ids else ids
                d.step(text_ids)
                if c.finish_reason is not None:
                    d.flush(text_ids)
                c.text = d.text[old:]
            _name_tokens(tok, c.logprobs)
        _name_tokens(tok, out.prompt_logprobs)


def _name_tokens(tokenizer, entries) -> None:
    for entry in entries or ():
        for tid, lp in (entry or {}).items():
            if lp.decoded_token is None:
                lp.decoded_token = tokenizer.decode([tid])


class _PidWatch:
    """Whether a process that is not this one's child has exited: a pidfd (Linux 5.3+) reads ready once it has, even
    while it waits unreaped; elsewhere signal 0 (which reads a zombie as alive until its parent reaps it)."""

    def __init__(self, pid: int):
        self.pid, self.fd, self.gone = pid, None, False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.gone = True
        except (AttributeError, OSError):     # no pidfd here: signal 0
            pass

    def exited(self) -> bool:
        if self.gone:
            return True
        if self.fd is not None:
            import select
            self.gone = bool(select.select([self.fd], [], [], 0)[0])
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.gone = True
            except PermissionError:           # alive, someone else's
                pass
        return self.gone

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class CoreClient(AsyncEngine):
    """Starts the engine core (`args`: the server's parsed arguments) and talks to it; `wait_ready()` returns
    once the model is loaded (ValueError with the core's message when it could not be).

    With several API processes (--api-server-count N), the first (index 0) starts the core with one output
    address per API process (`addresses`: (input address, [output addresses])); API process i > 0 is given
    (input address, [its output address]), index i and the core's pid (`core_pid`), and only talks to the core that
    the first one owns; it watches that pid, so that every API process fails its requests when the core dies."""

    def __init__(self, args, metrics=None, max_queue: int = 256, stats_interval: float = 10.0, *,
                 count: int = 1, index: int = 0, addresses: Optional[tuple] = None, core_pid: Optional[int] = None):
        import zmq

        super().__init__(None, metrics, max_queue=max_queue, stats_interval=stats_interval)
        self.index = index
        self._dir = None
        if addresses is None:
            self._dir = tempfile.mkdtemp(prefix="xllm-core-")
            addresses = (f"ipc://{self._dir}/in", [f"ipc://{self._dir}/out{i}" for i in range(count)])
        self.addresses = addresses
        in_addr, outs = addresses
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.SNDHWM, 0)         # queued, never blocking, until the core reads them
        self._pull.bind(outs[0] if index == 0 else outs[-1])
        self._push.connect(in_addr)                  # the core binds it
        self._send_lock = threading.Lock()
        self._pending: dict[Any, concurrent.futures.Future] = {}
        self._detoks: dict[Any, _RequestDetok] = {}
        self.info: Optional[dict] = None
        self.proc = None
        self.children: list = []                     # API processes 1..N-1 (their Popen), started by the server
        self._watch = _PidWatch(core_pid) if core_pid is not None else None
        if index == 0:
            self.proc = subprocess.Popen([sys.executable, "-m", "xllm_gen.runtime.serving.engine_core", in_addr,
                                          ",".join(outs), str(os.getpid())], stdin=subprocess.PIPE)
            self.proc.stdin.write(pickle.dumps(args))
            self.proc.stdin.close()

    @property
    def core_pid(self) -> Optional[int]:
        if self.proc is not None:
            return self.proc.pid
        return self._watch.pid if self._watch is not None else None

    def _core_exited(self) -> Optional[str]:
        """How the core ended ("exited with code -9") once it has, else None: the API process that started it has
        its exit code; the others watch its pid."""
        if self.proc is not None:
            rc = self.proc.poll()
            return None if rc is None else f"exited with code {rc}"
        if self._watch is not None and self._watch.exited():
            return f"exited (pid {self._watch.pid})"
        return None

    def wait_ready(self) -> CoreFrontend:
        # while the core loads the model: import what this process needs too (the tokenizer's libraries)
        import transformers  # noqa: F401

        import xllm_gen.runtime.engine.engine  # noqa: F401

        while True:
            if self._pull.poll(200):
                msg = pickle.loads(self._pull.recv())
                if msg[0] == "ready":
                    self.info = msg[1]
                    break
                if msg[0] == "failed":
                    self.stop()
                    raise ValueError(msg[1])
            elif (how := self._core_exited()) is not None:
                self.stop()
                raise RuntimeError(f"the engine core process {how} while loading the model (see the log above)")
        try:
            self.engine = CoreFrontend(self.info)
        except BaseException:
            self.stop()
            raise
        self.max_active = self.info["max_num_seqs"] + self.max_queue
        return self.engine

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, loop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._receive, name="xllm-core-output", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Asks the core to shut down (it aborts what is left and stops its TP ranks); kills it after
        `timeout`; closes the sockets."""
        import subprocess as sp

        self._stop = True
        for c in self.children:                # the other API processes first: they finish their requests
            if c.poll() is None:
                c.terminate()
        for c in self.children:
            try:
                c.wait(timeout)
            except sp.TimeoutExpired:
                c.kill()
                c.wait()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._send(("shutdown",))
            except RuntimeError:               # it is exiting already
                pass
            try:
                self.proc.wait(timeout)
            except sp.TimeoutExpired:
                pass
            if self.proc.poll() is None:
                logger.warning("the engine core did not stop in %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        if self._watch is not None:
            self._watch.close()
        if self._dir is not None:
            import shutil
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.error is None and self._core_exited() is None and self._thread is not None \
            and self._thread.is_alive()

    # ---- commands -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        """Sends without blocking (queued until the core reads it; RuntimeError should the queue refuse it)."""
        import zmq

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise RuntimeError("the engine is not running (the engine core process is gone)") from None

    async def add(self, request_id: Any, prompt: Any, params) -> asyncio.Queue:
        if not self.alive:
            raise RuntimeError("the engine is not running")
        if len(self._tracks) >= self.max_active:
            raise QueueFullError(f"too many requests in flight ({len(self._tracks)}); retry later")
        track = _Track(asyncio.Queue(), time.monotonic())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._tracks[request_id] = track
        self._pending[request_id] = fut
        self._detoks[request_id] = _RequestDetok(self.engine.tokenizer, params, self.engine.eos_token_ids)
        try:
            self._send(("add", request_id, prompt, params, track.arrival, self.index))
            await asyncio.wrap_future(fut)
        except BaseException:
            self._pending.pop(request_id, None)
            if self._tracks.pop(request_id, None) is not None:
                try:
                    self._send(("abort", request_id))
                except RuntimeError:
                    pass
            self._detoks.pop(request_id, None)
            raise
        return track.queue

    def abort(self, request_id: Any) -> None:
        track = self._tracks.pop(request_id, None)
        if track is not None and not track.done and self.metrics is not None:
            self.metrics.labels(self.metrics.success, finished_reason="abort").inc()
        self._detoks.pop(request_id, None)
        if self._core_exited() is None and not self._stop:
            try:
                self._send(("abort", request_id))
            except RuntimeError:               # the core is gone: nothing to abort
                pass

    # ---- the receiver thread --------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                if not self._pull.poll(200):
                    if self._stop:
                        return
                    how = self._core_exited()
                    if how is not None:
                        raise RuntimeError(f"the engine core process {how}")
                    continue
                msg = pickle.loads(self._pull.recv())
                kind = msg[0]
                if kind == "out":
                    outs, stats = msg[1], msg[2]
                    for out in outs:
                        det = self._detoks.get(out.request_id)
                        if det is not None:
                            if out.prompt_token_ids is None:          # sent with the first delta only
                                out.prompt_token_ids, out.prompt = det.prompt_ids, det.prompt
                            else:
                                det.prompt_ids, det.prompt = out.prompt_token_ids, out.prompt
                            det(out)
                            if out.finished:
                                self._detoks.pop(out.request_id, None)
                    self._account(outs, stats)
                    self._post([(o.request_id, o) for o in outs])
                    self._log_stats()
                elif kind == "stats":
                    if self.metrics is not None:
                        self.metrics.on_stats(msg[1], 0)
                elif kind == "added":
                    _, rid, err = msg
                    fut = self._pending.pop(rid, None)
                    if fut is None or not fut.set_running_or_notify_cancel():
                        continue
                    if err is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(ValueError(err[1]) if err[0] == "ValueError" else RuntimeError(err[1]))
                elif kind == "fail":
                    _, ids, name, message = msg
                    e = _core_error(name, message)
                    for rid in ids:
                        self._detoks.pop(rid, None)
                    self._post([(rid, e) for rid in ids])
                elif kind == "dead":
                    raise _core_error(msg[1], msg[2])
        except BaseException as e:          # noqa: BLE001 - reported through /health and to every request
            if self._stop:
                return
            logger.error("engine core failed: %s", e)
            self.error = e
            for fut in list(self._pending.values()):
                if not fut.done() and fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"the engine is not running: {e}"))
            self._post([(rid, e) for rid in list(self._tracks)])


def _core_error(name: str, message: str) -> Exception:
    """The core's exception, as one of the same name (the client's 500 says `name: message`)."""
    cls = type(name, (RuntimeError,), {}) if name.isidentifier() else RuntimeError
    return cls(message)
