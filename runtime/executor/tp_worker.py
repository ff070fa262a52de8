"""Tensor parallelism, what runs on every rank: joining the process groups, building the rank's runner (KV
blocks agreed over ranks), and the worker loop of ranks 1..N-1 (mirror rank 0's sequences from each step
description, run the step, answer queries), for spawned workers and torchrun ranks alike. Rank 0's side (the
TensorParallelRunner, failure handling, teardown) and the whole protocol are described in tp.py."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from itertools import chain
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from xllm_gen.runtime.engine.sequence import Sequence, SequenceStatus
from xllm_gen.runtime.executor import distributed as tpdist

_CONTROL_TIMEOUT = datetime.timedelta(days=365)   # workers wait for the next step while rank 0 is idle
_CPU = torch.device("cpu")
_STORE_PREFIX = "xllm_tp/"


def _class_path(cls) -> tuple[str, str]:
    mod, qual = cls.__module__, cls.__qualname__
    try:
        if _import_path((mod, qual)) is cls:
            return mod, qual
    except Exception:
        pass
    raise ValueError(f"runner class {cls!r} must be importable by name ({mod}.{qual}) to start rank processes")


def _import_path(path: tuple[str, str]):
    if path[0].split(".")[0] == "xllm_gen_user":     # a user's generated/ dir (XLLM_GEN_PATH): set up its namespace
        from xllm_gen.runtime.loading import registry
        registry.generated_packages()
    obj = importlib.import_module(path[0])
    for part in path[1].split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass
class _Launch:
    """What a spawned worker needs (picklable; the runner class travels by name)."""
    host: str
    port: int
    world_size: int
    device_type: str
    device_base: int
    timeout_s: float
    startup_timeout_s: float
    runner_path: tuple
    model_dir: str
    hf_config: dict
    runner_kwargs: dict
    parent_pid: int
    num_threads: int


@dataclasses.dataclass
class _RankState:
    rank: int
    size: int
    device: torch.device
    ctrl: Any                                  # gloo control group: step descriptions (no timeout)
    boot: Any                                  # gloo group for start-up agreements (start-up timeout)


def _join_group(rank: int, size: int, device: torch.device, timeout_s: float, startup_timeout_s: float, *,
                store=None, init_method: Optional[str] = None) -> _RankState:
    """Joins the default process group (the tensor group) and creates the gloo control groups."""
    cuda = device.type == "cuda"
    if cuda:
        # On a timeout or a failed peer, abort the communicators and raise instead of killing the process.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(device)
    kw: dict = dict(backend="nccl" if cuda else "gloo", rank=rank, world_size=size,
                    timeout=datetime.timedelta(seconds=timeout_s))
    if store is not None:
        kw["store"] = store
    else:
        kw["init_method"] = init_method
    if cuda:
        kw["device_id"] = device
    dist.init_process_group(**kw)
    # rank 0 sends the step descriptions and must not wait forever on a stopped worker; the workers wait for
    # the next step as long as rank 0 is idle (gloo timeouts are per process)
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s) if rank == 0
                          else _CONTROL_TIMEOUT)
    boot = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=startup_timeout_s))
    tpdist.init_process_group(rank, size, device=device)      # group exists: records the TP state only
    return _RankState(rank, size, device, ctrl, boot)


def _leave_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    tpdist.reset_tp()


def _all_reduce_int(value: int, op, ctrl) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=ctrl)
    return int(t.item())


def _build_rank_runner(runner_cls, model_dir: str, hf_config: dict, runner_kwargs: dict, state: _RankState):
    """runner_cls(...) on this rank, with the KV block count agreed over ranks (MIN). The agreements run
    on the start-up group: a rank stuck while loading is an error after the start-up timeout."""
    agree = lambda n: _all_reduce_int(n, dist.ReduceOp.MIN, state.boot)  # noqa: E731
    cls = runner_cls
    base_auto = getattr(runner_cls, "_auto_num_blocks", None)
    if callable(base_auto):
        # The runner sizes its KV cache from free memory, which may differ per rank: agree before allocating.
        cls = type(runner_cls.__name__, (runner_cls,),
                   {"_auto_num_blocks": lambda self, *a, **k: agree(base_auto(self, *a, **k)),
                    "__module__": runner_cls.__module__, "__qualname__": runner_cls.__qualname__})
    kwargs = dict(runner_kwargs)
    kwargs["device"] = state.device
    runner = cls(model_dir, hf_config, **kwargs)
    lo = agree(runner.num_kv_blocks)
    hi = _all_reduce_int(runner.num_kv_blocks, dist.ReduceOp.MAX, state.boot)
    if lo != hi and runner.num_kv_blocks != lo:
        _resize_kv(runner, lo)
    return runner


def _resize_kv(runner, n: int) -> None:
    if hasattr(runner, "resize_kv_cache"):
        runner.resize_kv_cache(n)
        return
    runner.num_kv_blocks = n
    if hasattr(runner, "_allocate_kv_cache"):
        for layer in getattr(runner, "attn_layers", ()):
            layer.k_cache = layer.v_cache = None
        runner._allocate_kv_cache()


# ----------------------------------------------------------------------------------------- rank queries
def _q_loaded_params(runner):
    return set(runner.loaded_params), {n for n, _ in runner.model.named_parameters()}


def _q_param(runner, name):
    return dict(runner.model.named_parameters())[name].detach().cpu().clone()


def _q_mirror(runner):
    return sorted(_WORKER_MIRROR.seqs) if _WORKER_MIRROR is not None else None


def _q_info(runner):
    model = getattr(runner, "model", None)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()} if model is not None else {}
    return {"rank": tpdist.get_tp_rank(), "pid": os.getpid(), "device": str(getattr(runner, "device", "")),
            "num_kv_blocks": runner.num_kv_blocks, "param_shapes": shapes}


_QUERIES = {"loaded_params": _q_loaded_params, "info": _q_info, "param": _q_param, "mirror": _q_mirror}
_WORKER_MIRROR = None           # a worker's mirror (for the "mirror" query)


# ---------------------------------------------------------------------------------------- control channel
# Rank 0 -> workers over the gloo control group. A step without new multimodal inputs travels packed in int64
# (header [_STEP, n], then the n values): nothing is pickled. Anything else (a query, shutdown, a step that
# carries images) follows the header [_OBJECT, 0] as one pickled object. Step items, per sequence:
#   (seq_id, token_offset, new_tokens, num_prompt_tokens, table_start, table_tail, num_computed, chunk_len, mm)
# the block table is sent as a change: the worker keeps table[:table_start] and appends table_tail (a table
# that only grew sends its new blocks, an unchanged one nothing).
_STEP, _OBJECT = 1, 2
_ITEM = 9                                  # packed int64 per sequence (every field of an item but mm)


def pack_step(is_prefill: bool, all_rows: bool, drops: list, items: list) -> Optional[np.ndarray]:
    """The step packed as int64 [is_prefill, all_rows, #drops, #items, drops, items' fields, tokens, table
    tails], or None when an item carries multimodal inputs (then the step is pickled)."""
    if any(it[8] is not None for it in items):
        return None
    nd, ni = len(drops), len(items)
    meta = [(it[0], it[1], len(it[2]), it[3], it[4], len(it[5]), it[6], it[7], it[9]) for it in items]
    toks = list(chain.from_iterable(it[2] for it in items))
    tails = list(chain.from_iterable(it[5] for it in items))
    head = 4 + nd + _ITEM * ni
    out = np.empty(head + len(toks) + len(tails), dtype=np.int64)
    try:
        out[:4] = (int(is_prefill), int(all_rows), nd, ni)
        out[4:4 + nd] = drops
        if ni:
            out[4 + nd:head] = np.asarray(meta, dtype=np.int64).reshape(-1)
        out[head:head + len(toks)] = toks
        out[head + len(toks):] = tails
    except (TypeError, ValueError, OverflowError):      # not all integers (e.g. a non-int sequence id): pickle
        return None
    return out


def unpack_step(packed) -> tuple:
    """("step", is_prefill, all_rows, drops, items) from pack_step's array."""
    a = packed.tolist()
    is_prefill, all_rows, nd, ni = a[:4]
    drops = a[4:4 + nd]
    p = 4 + nd
    metas = [a[p + i * _ITEM: p + (i + 1) * _ITEM] for i in range(ni)]
    tok = p + _ITEM * ni
    tab = tok + sum(m[2] for m in metas)
    items = []
    for sid, off, ntok, nprompt, tstart, ntab, computed, chunk, slot in metas:
        items.append((sid, off, a[tok:tok + ntok], nprompt, tstart, a[tab:tab + ntab], computed, chunk, None, slot))
        tok += ntok
        tab += ntab
    return ("step", bool(is_prefill), bool(all_rows), drops, items)


def send_control(msg: tuple, group) -> None:
    """Rank 0: one control message to every worker (see the channel's comment)."""
    packed = pack_step(*msg[1:]) if msg[0] == "step" else None
    if packed is not None:
        dist.broadcast(torch.tensor([_STEP, packed.size], dtype=torch.int64), src=0, group=group)
        dist.broadcast(torch.from_numpy(packed), src=0, group=group)
    else:
        dist.broadcast(torch.tensor([_OBJECT, 0], dtype=torch.int64), src=0, group=group)
        dist.broadcast_object_list([msg], src=0, group=group, device=_CPU)


def recv_control(group) -> tuple:
    """A worker: the next control message from rank 0."""
    head = torch.empty(2, dtype=torch.int64)
    dist.broadcast(head, src=0, group=group)
    kind, n = head.tolist()
    if kind == _STEP:
        packed = torch.empty(n, dtype=torch.int64)
        dist.broadcast(packed, src=0, group=group)
        return unpack_step(packed.numpy())
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group, device=_CPU)
    return box[0]


# --------------------------------------------------------------------------------------------- workers
class _Mirror:
    """A worker's copies of rank 0's sequences, updated from step descriptions."""

    def __init__(self):
        self.seqs: dict[int, Sequence] = {}

    def apply(self, drops, items) -> list[Sequence]:
        for sid in drops:
            self.seqs.pop(sid, None)
        out = []
        for sid, offset, new_tokens, num_prompt, table_start, table_tail, computed, chunk_len, mm_box, slot in items:
            seq = self.seqs.get(sid)
            if seq is None or offset == 0:
                seq = Sequence(sid, [], None)
                self.seqs[sid] = seq
            del seq.token_ids[offset:]
            seq.token_ids.extend(new_tokens)
            if mm_box is not None:
                seq.mm_inputs = mm_box[0]
            seq.num_prompt_tokens = num_prompt
            seq.block_table = seq.block_table[:table_start] + list(table_tail)
            seq.num_computed_tokens = computed
            seq.chunk_len = chunk_len
            seq.state_slot = None if slot < 0 else slot       # rank 0's recurrent-state slot (the same on every rank)
            seq.status = SequenceStatus.RUNNING
            out.append(seq)
        return out


def _serve(runner, state: _RankState) -> None:
    """A worker's loop: receive a message from rank 0, act on it, until "shutdown"."""
    global _WORKER_MIRROR
    mirror = _WORKER_MIRROR = _Mirror()
    while True:
        msg = recv_control(state.ctrl)
        kind = msg[0]
        if kind == "step":
            _, is_prefill, all_rows, drops, items = msg
            seqs = mirror.apply(drops, items)
            if seqs:
                runner.run(seqs, is_prefill, all_rows)
        elif kind == "query":
            dist.gather_object(_QUERIES[msg[1]](runner, *msg[2]), None, dst=0, group=state.ctrl)
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown control message {kind!r}")


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)                            # rank 0 is gone (killed): do not linger as an orphan
        time.sleep(0.5)


def _worker_entry(rank: int, launch: _Launch, reports) -> None:
    """Entry point of a spawned rank 1..N-1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is rank 0's to handle; it tells us to stop
    threading.Thread(target=_watch_parent, args=(launch.parent_pid,), daemon=True, name="xllm-tp-parent").start()
    try:
        reports.put(("hello", rank, os.getpid()))
        if launch.device_type == "cpu":
            torch.set_num_threads(launch.num_threads)
        runner_cls = _import_path(launch.runner_path)
        device = (torch.device("cuda", launch.device_base + rank) if launch.device_type == "cuda" else _CPU)
        store = dist.TCPStore(launch.host, launch.port, launch.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=launch.startup_timeout_s))
        state = _join_group(rank, launch.world_size, device, launch.timeout_s, launch.startup_timeout_s,
                            store=store)
        runner = _build_rank_runner(runner_cls, launch.model_dir, launch.hf_config, launch.runner_kwargs, state)
        reports.put(("ready", rank, os.getpid()))
        _serve(runner, state)
    except BaseException:
        try:
            reports.put(("error", rank, traceback.format_exc()))
            reports.close()
            reports.join_thread()                  # the report reaches rank 0 before our sockets close
        finally:
            os._exit(1)
    del runner
    _leave_group()
    reports.close()
    reports.join_thread()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)                                    # skip interpreter teardown: the group is already gone


def _torchrun_worker(runner_cls, model_dir, hf_config, runner_kwargs, env, state: _RankState):
    """A non-zero torchrun rank: serve until rank 0 shuts down, then exit the process (never returns)."""
    store = _default_store()
    try:
        runner = _build_rank_runner(runner_cls, model_dir, hf_config, runner_kwargs, state)
        _serve(runner, state)
    except BaseException:
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"{_STORE_PREFIX}error/{state.rank}", traceback.format_exc())
        raise
    _leave_group()
    sys.exit(0)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
