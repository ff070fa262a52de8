"""Tensor parallelism: one process per rank; rank 0 (the caller's process) schedules and samples. This file
is rank 0's side (TensorParallelRunner: start-up, steps); its process group's lifecycle (failures, the monitor,
teardown) is tp_group.py; what every rank runs (joining the groups, building its runner, the workers' step loop)
is in tp_worker.py.

    rank 0: LLMEngine -> TensorParallelRunner.run(seqs)        ranks 1..N-1: _serve() loop
        broadcast the step description (gloo control group) ----> rebuild equivalent Sequences
        runner.run(seqs)  <-- all-reduce / all-gather over the tensor group -->  runner.run(seqs)
        float32 logits [B, vocab] (ParallelLMHead gathers)                        (logits dropped)

Start-up. `TensorParallelRunner` first checks statically that the model can be split over N ranks
(`tp_check.check_tensor_parallel`: one ValueError, before any process starts). Single host: rank 0 opens a
TCPStore on a free port and starts ranks 1..N-1 with torch.multiprocessing's spawn context (daemon
processes); under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment) every rank runs
the user's script, the rendezvous is `env://`, rank 0 drives and the other ranks stay inside
`TensorParallelRunner(...)` serving steps until rank 0 shuts down, then exit (docs/tensor_parallel.md).
Each rank joins the default process group (NCCL with device cuda:rank on CUDA, gloo on CPU; the tensor
group, with a finite timeout), a gloo control group (step descriptions: rank 0's side has the same
finite timeout, so a stopped or stuck worker is an error on the next step instead of a hang; the workers'
side has none, since they wait for the next step as long as rank 0 is idle) and a gloo start-up group (the agreement after loading, with
the start-up timeout), records its place with `distributed.init_process_group`,
and builds `runner_cls(model_dir, hf_config, **runner_kwargs)`: its layers shard themselves from
get_tp_size/get_tp_rank and the loader reads only its slices. The KV block count is the minimum over
ranks (all-reduce MIN), so every rank's cache has the same pages.

Steps. Rank 0 keeps, per sequence, how many tokens and which block table the workers already hold; a step
carries only the new tokens (the whole prompt once, then one token per decode step), the block-table change
(new blocks, or the whole table when it was replaced), num_computed_tokens, chunk_len, and multimodal inputs
(tensors, CPU) the first time a sequence is seen. A step travels packed in int64 tensors over the control
group (tp_worker.send_control), pickled only when it carries multimodal inputs. Workers keep mirror
Sequence objects (dropped when rank 0's sequence finishes or is garbage-collected).

Failures. A worker that raises (at load time or in a step) sends its traceback to rank 0 (a
multiprocessing queue; the TCPStore under torchrun) and exits; its sockets close, so rank 0's pending
gloo collective fails at once, and rank 0 raises a RuntimeError carrying the worker's traceback. A
monitor thread on rank 0 also watches the worker processes (a rank killed by a signal is reported) and,
on CUDA, aborts the NCCL group so a blocked collective returns. Collectives and rank 0's control messages
have a finite timeout (XLLM_TP_TIMEOUT_S, default 300 s, read when the runner starts), so a stopped, stuck
or dead rank is an error naming the rank (stopped / gone / still running, from /proc), idle or mid-step,
not a hang. After a failure the group is torn down; the runner refuses further steps.

No orphans. Workers are daemon processes; `shutdown()` sends a shutdown message, joins with a timeout,
then terminates and kills; a weakref.finalize (also run at interpreter exit) does the same when the
runner is garbage-collected; workers ignore SIGINT and exit when their parent process disappears.
Ctrl-C on rank 0 during a step is deferred to the end of the step, so an interrupted generate() leaves a
usable engine. A second Ctrl-C interrupts at once, even while rank 0 is blocked inside a collective (where
Python runs no signal handler): the signal also reaches a wake-up socket that the monitor thread watches;
it kills the worker processes, the blocked collective fails, and the step raises KeyboardInterrupt with the
group torn down.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from xllm_gen.runtime.engine.sequence import Sequence, SequenceStatus
from xllm_gen.runtime.executor.tp_check import check_tensor_parallel, tensor_parallel_problems  # noqa: F401 (re-exported)
from xllm_gen.runtime.executor.tp_group import (  # noqa: F401 (is_driver, TensorParallelError: re-exported)
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    TensorParallelError,
    _defer_sigint,
    _env_seconds,
    _Group,
    _is_comm_error,
    _teardown,
    is_driver,
    torchrun_env,
)
from xllm_gen.runtime.executor.tp_worker import (
    _CPU,
    _QUERIES,
    _build_rank_runner,
    _class_path,
    _default_store,
    _join_group,
    _Launch,
    _torchrun_worker,
    _worker_entry,
    send_control,
)


def _to_cpu(obj):
    """Multimodal inputs travel pickled over gloo: CUDA tensors are moved to the CPU first."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu() if obj.device.type != "cpu" else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _to_cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if all(changes[k] is getattr(obj, k) for k in changes):
            return obj
        new = object.__new__(type(obj))
        new.__dict__.update(obj.__dict__)
        new.__dict__.update(changes)
        return new
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class _Sent:
    """What the workers hold of one sequence: its object (weakly), token count, multimodal inputs, block table."""
    __slots__ = ("ref", "ntok", "mm", "table")

    def __init__(self, ref, ntok, mm, table):
        self.ref, self.ntok, self.mm, self.table = ref, ntok, mm, table


class TensorParallelRunner:
    """A model runner over `tp_size` ranks with the interface LLMEngine uses: `num_kv_blocks`,
    `run(seqs, is_prefill, all_rows=False) -> float32 logits` (on rank 0), `shutdown()`, `config`.

    Rank 0's own runner is `.runner` (attributes not defined here are read from it, e.g. `.model`)."""

    supports_async_decode = False   # ranks receive each step's input tokens from rank 0's host

    def __init__(self, runner_cls, model_dir: str, hf_config: dict, tp_size: int, runner_kwargs: dict, *,
                 timeout_s: Optional[float] = None, startup_timeout_s: Optional[float] = None):
        model_module = getattr(runner_cls, "model_module", None)
        if model_module is not None:
            check_tensor_parallel(model_module, hf_config, tp_size)
        elif not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
        self.tp_size = tp_size
        self.timeout_s = float(timeout_s or _env_seconds("XLLM_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.startup_timeout_s = float(startup_timeout_s or _env_seconds("XLLM_TP_STARTUP_TIMEOUT_S",
                                                                         DEFAULT_STARTUP_TIMEOUT_S))
        if not (self.timeout_s > 0 and self.startup_timeout_s > 0):
            raise ValueError(f"tensor-parallel timeouts must be > 0 s, got {self.timeout_s} and "
                             f"{self.startup_timeout_s} (XLLM_TP_TIMEOUT_S / XLLM_TP_STARTUP_TIMEOUT_S)")
        device = torch.device(runner_kwargs.get("device") or "cpu")
        env = torchrun_env()
        if env is not None and env["world_size"] != tp_size:
            raise ValueError(f"under torchrun, tensor_parallel_size ({tp_size}) must equal WORLD_SIZE "
                             f"({env['world_size']})")
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialized in this process (another tensor-parallel "
                             "LLM is alive?): shut it down before starting a new one")
        if device.type == "cuda":
            base = 0 if env is not None else (device.index or 0)
            n_dev = torch.cuda.device_count()
            local_n = tp_size if env is None else None
            if local_n is not None and base + local_n > n_dev:
                raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs from cuda:{base}, but "
                                 f"{n_dev} are visible (for several hosts, launch with torchrun)")
        elif device.type != "cpu":
            raise ValueError(f"tensor parallelism runs on cuda or cpu devices, not {device}")
        self._sent: dict[int, _Sent] = {}
        self._group: Optional[_Group] = None
        self._finalizer = None
        self.runner = None
        try:
            if env is None:
                self._start_spawn(runner_cls, model_dir, hf_config, runner_kwargs, device)
            else:
                self._start_torchrun(runner_cls, model_dir, hf_config, runner_kwargs, device, env)
        except BaseException as e:
            if self._group is not None:
                self._fail(e, "start-up")
            raise

    # ---- start-up -------------------------------------------------------------------------------
    def _start_spawn(self, runner_cls, model_dir, hf_config, runner_kwargs, device) -> None:
        import torch.multiprocessing as mp

        path = _class_path(runner_cls)
        store = dist.TCPStore("127.0.0.1", 0, self.tp_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.startup_timeout_s))
        ctx = mp.get_context("spawn")
        reports = ctx.Queue()
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:
            cpus = os.cpu_count() or 1
        launch = _Launch("127.0.0.1", store.port, self.tp_size, device.type,
                         (device.index or 0) if device.type == "cuda" else 0, self.timeout_s,
                         self.startup_timeout_s, path, str(model_dir), dict(hf_config), dict(runner_kwargs),
                         os.getpid(), max(1, cpus // self.tp_size))
        procs = [ctx.Process(target=_worker_entry, args=(r, launch, reports), daemon=True, name=f"xllm-tp-rank{r}")
                 for r in range(1, self.tp_size)]
        group = self._group = _Group(self.tp_size, device, procs, reports)
        group.timeout_s = self.timeout_s
        if device.type == "cpu":       # the ranks share this host's cores: rank 0 takes its share too
            group.saved_threads = torch.get_num_threads()
            torch.set_num_threads(launch.num_threads)
        self._finalizer = weakref.finalize(self, _teardown, group)
        for p in procs:
            p.start()
        # Every worker must be alive and past its imports before rank 0 blocks in the rendezvous.
        deadline = time.monotonic() + self.startup_timeout_s
        while len(group.pids) < len(procs):
            group.drain(timeout=0.1)
            if group.failures:
                hint = ""
                if len(group.pids) < len(procs) and not any("Traceback" in t for t in group.failures.values()):
                    hint = ("\n(a rank that exits before running any code usually means the script that "
                            "creates the LLM lacks the `if __name__ == \"__main__\":` guard: ranks are "
                            "started with multiprocessing's spawn, which re-imports the main module)")
                raise TensorParallelError(f"start-up failed: {group.describe()}{hint}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {self.startup_timeout_s:.0f} s")
        dev0 = device if device.type == "cpu" else torch.device("cuda", launch.device_base)
        state = _join_group(0, self.tp_size, dev0, self.timeout_s, self.startup_timeout_s, store=store)
        group.ctrl = state.ctrl
        group.keep = store                        # the TCPStore master lives as long as the group
        group.start_monitor()
        self.runner = _build_rank_runner(runner_cls, model_dir, hf_config, runner_kwargs, state)

    def _start_torchrun(self, runner_cls, model_dir, hf_config, runner_kwargs, device, env) -> None:
        rank = env["rank"]
        dev = torch.device("cuda", env["local_rank"]) if device.type == "cuda" else _CPU
        state = _join_group(rank, self.tp_size, dev, self.timeout_s, self.startup_timeout_s, init_method="env://")
        if rank != 0:
            _torchrun_worker(runner_cls, model_dir, hf_config, runner_kwargs, env, state)   # exits
        group = self._group = _Group(self.tp_size, dev, store=_default_store())
        group.timeout_s = self.timeout_s
        group.ctrl = state.ctrl
        self._finalizer = weakref.finalize(self, _teardown, group)
        group.start_monitor()
        self.runner = _build_rank_runner(runner_cls, model_dir, hf_config, runner_kwargs, state)

    # ---- the interface LLMEngine uses ------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def config(self):
        return self.runner.config

    @property
    def loaded_params(self):
        return self.runner.loaded_params

    def __getattr__(self, name):
        runner = self.__dict__.get("runner")
        if runner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(runner, name)

    def run(self, seqs: list[Sequence], is_prefill: bool, all_rows: bool = False) -> torch.Tensor:
        """One step on every rank; float32 logits [B, vocab] of each sequence's last row (all rows of the
        step when all_rows), as computed on rank 0."""
        self._check_usable()
        msg, commit = self._step_message(seqs, is_prefill, all_rows)
        group = self._group
        try:
            with _defer_sigint(group):
                group.in_step = True
                try:
                    send_control(msg, group.ctrl)
                    commit()
                    logits = self.runner.run(seqs, is_prefill, all_rows)
                except BaseException as e:
                    self._fail(e, "a step")
                finally:
                    group.in_step = False
        except KeyboardInterrupt:
            if group.interrupted:
                group.teardown(graceful=False)
            raise
        if group.interrupted:                     # the step finished although the workers were killed
            group.teardown(graceful=False)
            raise KeyboardInterrupt
        if group.failures:                        # a rank failed after its last collective of the step
            self._check_usable()
        return logits

    def rollback_tokens(self, seq_id: int, num_tokens: int) -> None:
        """Rank 0's sequence dropped its tokens past `num_tokens` (speculative decoding: the drafts of a
        verification, which the workers received): its next step sends the tokens from there again."""
        entry = self._sent.get(seq_id)
        if entry is not None and entry.ntok > num_tokens:
            entry.ntok = num_tokens

    def _step_message(self, seqs, is_prefill: bool, all_rows: bool):
        """(message, commit): the step description, and a function recording what the workers then hold
        (called once the broadcast went out, so a failure while building the message changes nothing)."""
        sent = self._sent
        live = {s.seq_id for s in seqs}
        drops = [sid for sid, e in sent.items() if sid not in live
                 and ((seq := e.ref()) is None or seq.status == SequenceStatus.FINISHED)]
        items, updates = [], {}
        for seq in seqs:
            entry = sent.get(seq.seq_id)
            toks = seq.token_ids
            fresh = entry is None or entry.ref() is not seq or entry.ntok > len(toks)
            offset = 0 if fresh else entry.ntok
            mm_ref = None if fresh else entry.mm
            mm_box = None
            if seq.mm_inputs is not None and (mm_ref is None or mm_ref() is not seq.mm_inputs):
                mm_box = (_to_cpu(seq.mm_inputs),)
                mm_ref = _ref_or_const(seq.mm_inputs)
            table, held = seq.block_table, None if fresh else entry.table
            if held is not None and table == held:                        # unchanged: send nothing
                start, tail = len(held), []
            elif held is not None and len(table) > len(held) and table[:len(held)] == held:
                start, tail = len(held), table[len(held):]                # grew: send the new blocks
            else:
                start, tail, held = 0, list(table), None
            items.append((seq.seq_id, offset, toks[offset:], seq.num_prompt_tokens, start, tail,
                          seq.num_computed_tokens, seq.chunk_len, mm_box,
                          -1 if seq.state_slot is None else seq.state_slot))
            updates[seq.seq_id] = _Sent(weakref.ref(seq), len(toks), mm_ref,
                                        held if held is not None and not tail else list(table))

        def commit():
            for sid in drops:
                sent.pop(sid, None)
            sent.update(updates)
        return ("step", bool(is_prefill), bool(all_rows), drops, items), commit

    # ---- tests and tools ------------------------------------------------------------------------
    def gather(self, query: str, *args) -> list:
        """Every rank's answer to a named query, in rank order: "loaded_params", "info", "param" (name),
        "mirror" (the sequence ids a rank holds; rank 0: those it has sent)."""
        if query not in _QUERIES:
            raise ValueError(f"unknown query {query!r}; known: {', '.join(_QUERIES)}")
        self._check_usable()
        group = self._group
        out = [None] * self.tp_size
        mine = sorted(self._sent) if query == "mirror" else _QUERIES[query](self.runner, *args)
        try:
            with _defer_sigint(group):
                group.in_step = True
                try:
                    send_control(("query", query, args), group.ctrl)
                    dist.gather_object(mine, out, dst=0, group=group.ctrl)
                except BaseException as e:
                    self._fail(e, f"query {query!r}")
                finally:
                    group.in_step = False
        except KeyboardInterrupt:
            if group.interrupted:
                group.teardown(graceful=False)
            raise
        return out

    def loaded_param_sets(self) -> list[tuple[set, set]]:
        """Per rank: (names the loader filled, names of the model's parameters)."""
        return self.gather("loaded_params")

    def rank_info(self) -> list[dict]:
        """Per rank: pid, device, num_kv_blocks, per-rank parameter shapes."""
        return self.gather("info")

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._group.procs] if self._group else []

    # ---- failures and shutdown ------------------------------------------------------------------
    def _check_usable(self) -> None:
        group = self._group
        if group is None:
            raise TensorParallelError("the tensor-parallel runner did not start")
        if not group.closed and group.failures:
            group.wait_for_root_cause(2.0)
            group.teardown(graceful=False)
        if group.closed:
            why = f":\n{group.describe()}" if group.failures else ""
            raise TensorParallelError(f"the tensor-parallel group is shut down{why}")

    def _fail(self, exc: BaseException, where: str):
        """Tears the group down after `exc` on rank 0 and raises the most useful error: when rank 0 only saw
        a broken connection or a timeout, the failing worker's traceback; else rank 0's own exception."""
        group = self._group
        if group.interrupted or isinstance(exc, KeyboardInterrupt):
            group.interrupted = True
            group.teardown(graceful=False)
            raise KeyboardInterrupt from None      # a second Ctrl-C: the workers were killed on purpose
        if isinstance(exc, TensorParallelError):
            group.teardown(graceful=False)
            raise exc
        comm = _is_comm_error(exc)
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()   # a stuck rank: no report
        group.wait_for_root_cause(0.5 if timed_out or not comm else 5.0)
        stuck = group.unresponsive() if comm and timed_out and not group.root_failures() else ""
        group.teardown(graceful=False)
        if comm:
            if stuck:
                raise TensorParallelError(f"tensor parallelism failed during {where}: timed out, no answer within "
                                          f"{self.timeout_s:g} s (XLLM_TP_TIMEOUT_S): {stuck}") from None
            if group.failures:
                raise TensorParallelError(f"tensor parallelism failed during {where}: {group.describe()}") from exc
            raise TensorParallelError(f"tensor parallelism failed during {where} (rank 0: {exc})") from exc
        raise exc

    def shutdown(self) -> None:
        """Stops every rank (idempotent): shutdown message, join with a timeout, then terminate/kill."""
        if self._finalizer is not None:
            self._finalizer()
        elif self._group is not None:
            self._group.teardown()


def _ref_or_const(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
