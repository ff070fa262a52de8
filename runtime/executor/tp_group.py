"""Tensor parallelism, rank 0's view of its worker processes (tp.py's TensorParallelRunner holds one): the process
group's lifecycle (a monitor thread, failure reports, root causes, teardown without orphans), the timeouts, and
Ctrl-C deferred to the end of a step. See tp.py's docstring for the whole design."""
from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import select
import signal
import socket
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from xllm_gen.runtime.executor.tp_worker import _STORE_PREFIX, _leave_group, send_control


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


DEFAULT_TIMEOUT_S = 300.0           # XLLM_TP_TIMEOUT_S: one collective or control message of a step
DEFAULT_STARTUP_TIMEOUT_S = 600.0   # XLLM_TP_STARTUP_TIMEOUT_S: process start + rendezvous + loading
COLLECTIVE_TIMEOUT_S = _env_seconds("XLLM_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)          # at import (compat)
STARTUP_TIMEOUT_S = _env_seconds("XLLM_TP_STARTUP_TIMEOUT_S", DEFAULT_STARTUP_TIMEOUT_S)
SHUTDOWN_TIMEOUT_S = 10.0                                              # graceful exit before terminate


# =========================================================================================== launching
def torchrun_env() -> Optional[dict]:
    """The torchrun (torch.distributed.elastic) environment of this process, or None outside torchrun."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))}


def is_driver() -> bool:
    """False only on the non-zero ranks of a torchrun launch (they serve steps inside LLM(...) and exit)."""
    env = torchrun_env()
    return env is None or env["rank"] == 0


# ============================================================================================ teardown
class TensorParallelError(RuntimeError):
    """A rank failed (its traceback is in the message), a collective timed out, or the group is shut down."""


_COMM_MARKERS = ("Connection closed by peer", "Connection reset", "Timed out waiting", "gloo", "NCCL",
                 "c10d", "Broken pipe", "ProcessGroup")


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def _is_comm_report(text: str) -> bool:
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return any(m in last for m in _COMM_MARKERS)


class _Group:
    """Everything teardown needs, held apart from the runner: the monitor thread and the finalizer keep
    this object alive, never the runner, so dropping the runner lets it be collected (and torn down)."""

    def __init__(self, size: int, device: torch.device, procs=(), reports=None, store=None):
        self.size = size
        self.device = device
        self.procs: list = list(procs)             # spawned ranks 1..N-1 (empty under torchrun)
        self.reports = reports                     # multiprocessing queue from the workers
        self.store = store                         # torchrun: workers' error reports
        self.ctrl = None
        self.failures: dict[int, str] = {}         # rank -> traceback text (or exit description)
        self.pids: dict[int, int] = {}
        self.ready: set[int] = set()
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.closed = False
        self.in_step = False
        self.monitor: Optional[threading.Thread] = None
        self.keep = None
        self.saved_threads: Optional[int] = None   # rank 0's torch threads before the group (CPU)
        self.timeout_s: Optional[float] = None
        self.sigints = 0                           # Ctrl-C seen by the monitor during the current step
        self.interrupted = False                   # a second Ctrl-C aborted the group
        self.wake_r = self.wake_w = None           # signal wake-up socket (signal.set_wakeup_fd)
        with contextlib.suppress(Exception):
            self.wake_r, self.wake_w = socket.socketpair()
            self.wake_r.setblocking(False)
            self.wake_w.setblocking(False)

    # -- failure intake
    def drain(self, timeout: float = 0.0) -> None:
        """Moves pending reports into pids/ready/failures (waiting up to `timeout` for the first queued one)
        and notes ranks that died without a report. Called by the monitor thread and by rank 0's thread."""
        with self.lock:
            self._drain_queue(timeout)
            if self.store is not None:
                for r in range(1, self.size):
                    key = f"{_STORE_PREFIX}error/{r}"
                    with contextlib.suppress(Exception):
                        if r not in self.failures and self.store.check([key]):
                            self.failures[r] = self.store.get(key).decode(errors="replace")
            dead = [(r, p) for r, p in enumerate(self.procs, start=1)
                    if p.exitcode is not None and r not in self.failures and not self.closed]  # not our kill
            if dead:
                self._drain_queue(0.05)        # a report may still be in flight
                for r, p in dead:
                    if r not in self.failures:
                        code = p.exitcode
                        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                        self.failures[r] = f"rank {r} (pid {p.pid}) {how} without a report (see its stderr)"

    def _drain_queue(self, timeout: float) -> None:
        if self.reports is None:
            return
        block = timeout > 0
        while True:
            try:
                kind, rank, payload = self.reports.get(True, timeout) if block else self.reports.get_nowait()
            except (queue_mod.Empty, EOFError, OSError, ValueError):
                return
            block = False
            if kind == "hello":
                self.pids[rank] = payload
            elif kind == "ready":
                self.ready.add(rank)
            elif kind == "error":
                self.failures[rank] = payload

    def root_failures(self) -> list[tuple[int, str]]:
        """Failures, root causes first (a rank that merely lost its peers reports a connection error)."""
        items = sorted(self.failures.items())
        return sorted(items, key=lambda kv: _is_comm_report(kv[1]))

    def wait_for_root_cause(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain(timeout=0.1)
            if any(not _is_comm_report(t) for t in self.failures.values()):
                return
            if self.procs and all(p.exitcode is not None for p in self.procs):
                self.drain()
                return

    def unresponsive(self) -> str:
        """Why no answer came (called on a timeout, before teardown): each worker stopped, gone, or running."""
        if not self.procs:
            return "a rank did not answer (under torchrun: check every rank's host)"
        parts, running = [], []
        for r, p in enumerate(self.procs, start=1):
            state = _proc_state(p.pid)
            if state in ("T", "t"):
                parts.append(f"rank {r} (pid {p.pid}) is stopped (SIGSTOP, job control or a debugger)")
            elif state in (None, "Z", "X") or p.exitcode is not None:
                parts.append(f"rank {r} (pid {p.pid}) is gone")
            else:
                running.append(f"rank {r} (pid {p.pid})")
        if running:
            parts.append(f"{', '.join(running)} {'is' if len(running) == 1 else 'are'} running but did not answer "
                         f"(stuck in a step?)")
        return "; ".join(parts)

    def describe(self) -> str:
        roots = self.root_failures()
        if not roots:
            return "no rank reported an error"
        (rank, text), rest = roots[0], roots[1:]
        msg = f"tensor-parallel rank {rank} of {self.size} failed:\n{text.rstrip()}"
        for r, t in rest:
            last = t.strip().splitlines()[-1] if t.strip() else t
            msg += f"\n(rank {r} also stopped: {last})"
        return msg

    # -- monitor
    def start_monitor(self) -> None:
        self.monitor = threading.Thread(target=self._monitor, daemon=True, name="xllm-tp-monitor")
        self.monitor.start()

    def _wait_tick(self) -> bool:
        """Waits up to 0.2 s, reading the signal wake-up socket; False when the group is stopping."""
        if self.wake_r is None:
            return not self.stop.wait(0.2)
        with contextlib.suppress(Exception):
            ready, _, _ = select.select([self.wake_r], [], [], 0.2)
            if ready:
                data = self.wake_r.recv(256)
                n = data.count(bytes([int(signal.SIGINT)]))
                if n and self.in_step:
                    self.sigints += n
                    if self.sigints >= 2 and not self.interrupted:
                        self.interrupt()
        return not self.stop.is_set()

    def interrupt(self) -> None:
        """A second Ctrl-C during a step: kill the workers so that rank 0's blocked collective fails now."""
        self.interrupted = True
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
        if self.device.type == "cuda":
            self._abort_nccl()

    def _monitor(self) -> None:
        while self._wait_tick():
            with contextlib.suppress(Exception):
                n = len(self.failures)
                self.drain()
                if len(self.failures) > n and self.in_step and self.device.type == "cuda":
                    self._abort_nccl()     # a blocked NCCL collective never notices a dead peer by itself

    def _abort_nccl(self) -> None:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                abort(dist.group.WORLD)

    # -- teardown
    def teardown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(2.0)                 # before the groups and the store go away
        if graceful and any(_proc_state(p.pid) in ("T", "t") for p in self.procs if p.pid):
            graceful = False                       # a stopped rank would hold the shutdown message for the timeout
        if graceful and self.ctrl is not None and not self.failures:
            with contextlib.suppress(Exception):
                send_control(("shutdown",), self.ctrl)
        deadline = time.monotonic() + (SHUTDOWN_TIMEOUT_S if graceful else 0.5)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(Exception):
                    os.kill(p.pid, signal.SIGCONT)     # a stopped rank acts on SIGTERM only once continued
        for p in self.procs:
            p.join(3.0)
            if p.is_alive():
                p.kill()
                p.join(3.0)
        if self.failures and self.device.type == "cuda":
            self._abort_nccl()
        _leave_group()
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
        if self.reports is not None:
            with contextlib.suppress(Exception):
                self.drain()
                self.reports.cancel_join_thread()
                self.reports.close()
        for sock in (self.wake_r, self.wake_w):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close()


def _proc_state(pid: int) -> Optional[str]:
    """The process state letter from /proc (R, S, D, T, t, Z, ...), None when gone, '?' off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except Exception:
        return "?"


def _teardown(group: _Group) -> None:          # the finalizer (garbage collection, interpreter exit)
    with contextlib.suppress(Exception):
        group.teardown(graceful=True)


# ========================================================================================= the driver
@contextlib.contextmanager
def _defer_sigint(group: Optional["_Group"] = None):
    """Ctrl-C during a step takes effect when the step ends (every rank is then between steps); a second
    Ctrl-C interrupts at once. Only in the main thread, and only over Python's default handler.

    With a group, the signal also goes to the group's wake-up socket: the monitor thread counts it even
    while this thread is blocked in a collective (no Python handler runs there) and, on the second one,
    kills the workers so that the collective fails (group.interrupted; the caller raises KeyboardInterrupt)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    hits = []
    wake = group.wake_w if group is not None and group.monitor is not None else None

    def handler(signum, frame):
        hits.append(signum)
        if len(hits) > 1 and wake is None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
    old_fd = None
    if wake is not None:
        group.sigints = 0
        try:
            old_fd = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            wake = None
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if wake is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(old_fd if old_fd is not None else -1)
    if hits:
        raise KeyboardInterrupt
