"""The engine core in its own process: scheduler, model runner(s) and sampler, driven over ZeroMQ.

`xllm-gen-serve` starts this module as a child process (runtime/serving/core_client.py, vLLM V1's layout):
this process binds the ipc:// input socket, every API process (one, or --api-server-count) binds its own
output socket, which this process connects to,

    API process i  --PUSH-->  ("add", rid, prompt, params, arrival, i) / ("abort", rid) / ("shutdown",) --> core
    API process i  <--PULL--  ("ready", info) / ("failed", message)                                    <-- core
                            ("added", rid, None | (kind, message))
                            ("out", [RequestOutput deltas], stats) / ("stats", stats)
                            ("fail", [rid], kind, message)             a step failed: these requests fail

pickled; a request's messages go to the API process that added it, gauges and ready / failed / dead to all.
A request's prompt (its token ids and text) travels in its first delta only (the later ones carry None, which the
API process fills from the first): unpickling a 1k-token prompt with every token of 64 streams was the API
process's largest cost.
The core drains every queued command before each step and steps while requests are unfinished; the deltas it
sends carry token ids (text only for requests with stop strings, which it must find itself): the API process
detokenizes. Structured outputs are masked here, where the sampler runs, and compiled here in worker threads
(a request waits for its grammar off the step loop, which keeps stepping the others).

No orphans: the core dies with the API process even when that one is SIGKILLed (PR_SET_PDEATHSIG, and a
parent-pid watch where prctl is missing); its tensor-parallel ranks watch this process in turn. SIGINT (Ctrl-C
reaches the whole process group) is left to the API process, which shuts the core down in order."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

logger = logging.getLogger("xllm_gen.serving.core")

# A test hook (tests/test_serving_core.py): a request whose prompt contains this text makes the core's step fail,
# to check that a failing step reaches the client as an HTTP 500 naming the error while the server stays up.
FAULT_ENV = "XLLM_TEST_FAIL_STEP_ON"


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent dies (Linux prctl), and a thread watching the parent pid."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)                 # PR_SET_PDEATHSIG
    except Exception:                                 # not Linux: the watch thread alone
        pass
    if os.getppid() != parent_pid:                    # died before prctl took effect
        os._exit(1)

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="xllm-core-parent").start()


def engine_info(engine) -> dict:
    """What the API process needs of the engine (start-up line, /v1/models, tokenizer, admission checks)."""
    bm = engine.block_manager
    per_block = getattr(engine.runner, "_kv_bytes_per_block", None)
    return {"model_dir": str(engine.model_dir), "tokenizer_dir": str(engine.tokenizer_dir),
            "has_tokenizer": engine.tokenizer is not None, "hf_config": engine.hf_config,
            "multimodal": engine.mm_processor is not None, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size, "eos_token_ids": sorted(engine.eos_token_ids),
            "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
            "num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "kv_bytes": per_block() * bm.num_blocks if callable(per_block) else None,
            "max_num_seqs": engine.scheduler.max_num_seqs, "pid": os.getpid(),
            "default_sampling": engine.default_sampling}


def _error(e: BaseException) -> tuple:
    return ("ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e))


class EngineCore:
    def __init__(self, engine, pull, pushes: list):
        self.engine, self.pull, self.pushes = engine, pull, pushes
        self.client_of: dict = {}                      # request id -> index of the API process that added it
        self.fault = os.environ.get(FAULT_ENV) or None
        self.compiling: dict = {}                      # request id -> (compile future, its "add" message)
        self.prompt_sent: set = set()                  # request ids whose prompt went out with a delta
        self._pool = None

    def admit(self, msg) -> None:
        """An "add": a request with a structured-outputs constraint is admitted once a worker thread has compiled
        it (cached; the step loop never waits on a compile); the others at once."""
        _, rid, prompt, params, arrival, client = msg
        so = getattr(params, "structured_outputs", None)
        if so is not None and rid not in self.compiling:
            try:
                backend = self.engine.structured          # built here, in the loop's thread
            except Exception as e:
                self.send(("added", rid, _error(e)), client)
                return
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="xllm-grammar")
            self.compiling[rid] = (self._pool.submit(backend.compile, so), msg)
            return
        self.compiling.pop(rid, None)
        try:
            self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            self.client_of[rid] = client
            self.send(("added", rid, None), client)
        except Exception as e:
            self.send(("added", rid, _error(e)), client)

    def admit_compiled(self) -> int:
        """Admits the requests whose constraint has compiled (a failed compile fails again, named, in add_request)."""
        done = [msg for fut, msg in self.compiling.values() if fut.done()]
        for msg in done:
            self.admit(msg)
        return len(done)

    def send(self, msg, client: int) -> None:
        self.pushes[client].send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def broadcast(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for push in self.pushes:
            push.send(data, copy=False)

    def send_per_client(self, kind: str, items: list, *rest) -> None:
        """("out" / "fail", the items of each API process, *rest) to each API process that has some."""
        per: dict = {}
        if kind == "out":
            for out in items:                          # the prompt with a request's first delta only
                if out.request_id in self.prompt_sent:
                    out.prompt_token_ids = out.prompt = None
                elif not out.finished:
                    self.prompt_sent.add(out.request_id)
        for item in items:
            rid = item.request_id if kind == "out" else item
            per.setdefault(self.client_of.get(rid, 0), []).append(item)
        for client, mine in per.items():
            self.send((kind, mine, *rest), client)

    def run(self) -> None:
        import zmq

        from xllm_gen.runtime.serving.metrics import engine_stats

        engine = self.engine
        while True:
            if not engine.has_unfinished_requests() and not self.pull.poll(5 if self.compiling else 500) \
                    and not self.compiling:
                continue
            n = self.admit_compiled() if self.compiling else 0
            while True:                                    # every queued command before the next step
                try:
                    msg = pickle.loads(self.pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                n += 1
                if msg[0] == "add":
                    self.admit(msg)
                elif msg[0] == "abort":
                    engine.abort_request(msg[1])
                    self.client_of.pop(msg[1], None)
                    self.prompt_sent.discard(msg[1])
                    self.compiling.pop(msg[1], None)
                elif msg[0] == "shutdown":
                    return
            if n:
                self.broadcast(("stats", engine_stats(engine)))
            if not engine.has_unfinished_requests():
                continue
            try:
                if self.fault and any(self.fault in (s.prompt or "")
                                                for s in [*engine.scheduler.running, *engine.scheduler.waiting]):
                    raise RuntimeError(f"injected fault ({FAULT_ENV})")
                outs = engine.step_deltas()
            except Exception as e:           # a failing step fails the requests in flight, not the server
                logger.exception("engine step failed; failing the requests in flight")
                ids = engine.abort_all()
                self.send_per_client("fail", ids, *_error(e))
                for rid in ids:
                    self.client_of.pop(rid, None)
                    self.prompt_sent.discard(rid)
                continue
            self.send_per_client("out", outs, engine_stats(engine))
            if len(self.pushes) > 1:                # the other API processes' gauges
                st = engine_stats(engine)
                for client in set(range(len(self.pushes))) - {self.client_of.get(o.request_id, 0) for o in outs}:
                    self.send(("stats", st), client)
            for o in outs:
                if o.finished:
                    self.client_of.pop(o.request_id, None)
                    self.prompt_sent.discard(o.request_id)


def main() -> int:
    in_addr, out_addrs, parent_pid = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C: the API process shuts the core down
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)                                 # before loading: the API processes connect meanwhile
    pushes = []
    for addr in out_addrs:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(addr)
        pushes.append(push)
    args = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")

    def send(msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for push in pushes:
            push.send(data)

    from xllm_gen.runtime.serving.server import make_engine

    try:
        engine = make_engine(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        send(("failed", str(e)))
        for push in pushes:
            push.close()
        return 2
    except BaseException as e:                      # noqa: BLE001 - reported to the API process, then raised
        send(("failed", f"{type(e).__name__}: {e}"))
        for push in pushes:
            push.close()
        raise
    engine.detokenize = False                       # the API process detokenizes
    rc = 0
    try:
        send(("ready", engine_info(engine)))
        EngineCore(engine, pull, pushes).run()
    except BaseException as e:                      # noqa: BLE001 - the API process fails its requests
        logger.exception("engine core died")
        send(("dead", *_error(e)))
        rc = 1
    finally:
        try:
            engine.abort_all()
        except Exception:
            pass
        engine.shutdown()
        pull.close(0)
        for push in pushes:
            push.close()
        ctx.term()
    return rc


if __name__ == "__main__":
    sys.exit(main())
