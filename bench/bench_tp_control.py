"""The TP control path on CPU (gloo, 2 processes on one host): the time of one decode step's description from
rank 0 to a worker, received, applied to the worker's mirror, and met by a first collective (a 1-element
all-reduce, standing for the forward's first all-reduce that waits for the worker). Compared, in the same run:

  pickled  the step as before: dist.broadcast_object_list of the message with every sequence's whole block table;
  packed   runtime/executor/tp_worker.send_control / recv_control: int64, block tables as changes.

    python bench/bench_tp_control.py [--batch-sizes 1,16,64,256] [--table 64] [--steps 300]

Medians of per-step times on rank 0 (ms). Runs anywhere (CPU only): the cost is host work and one loopback
round trip, the same on a GPU host's control group.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, port: int, batches: list, table: int, steps: int, out) -> None:
    from xllm_gen.runtime.engine.sequence import Sequence
    from xllm_gen.runtime.executor.tp import TensorParallelRunner
    from xllm_gen.runtime.executor.tp_worker import _Mirror, recv_control, send_control
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)

    class _Rank0:
        _step_message = TensorParallelRunner._step_message

        def __init__(self):
            self._sent = {}

    one = torch.zeros(1)
    res = {}
    for B in batches:
        for mode in ("pickled", "packed"):
            seqs = [Sequence(i, list(range(1000)), None) for i in range(B)]
            for i, s in enumerate(seqs):
                s.block_table = list(range(i * table, (i + 1) * table))
            rank0, mirror, times = _Rank0(), _Mirror(), []
            for k in range(steps):
                for s in seqs:                              # one decode token; a new block every 16 steps
                    s.token_ids.append(k)
                    if k % 16 == 15:
                        s.block_table.append(10**6 + k)
                dist.barrier()
                t = time.perf_counter()
                if rank == 0:
                    msg, commit = rank0._step_message(seqs, False, False)
                    if mode == "pickled":                   # the former message: whole tables, pickled
                        msg = msg[:4] + ([(it[0], it[1], it[2], it[3], list(s.block_table), it[6], it[7], it[8])
                                          for it, s in zip(msg[4], seqs)],)
                        dist.broadcast_object_list([msg], src=0)
                    else:
                        send_control(msg, None)
                    commit()
                else:
                    if mode == "pickled":
                        box = [None]
                        dist.broadcast_object_list(box, src=0)
                        items = [it[:4] + (0, it[4]) + it[5:] for it in box[0][4]]
                        mirror.apply(box[0][3], items)
                    else:
                        msg = recv_control(None)
                        mirror.apply(msg[3], msg[4])
                dist.all_reduce(one)
                times.append(time.perf_counter() - t)
            if rank == 0:
                res[(B, mode)] = 1e3 * statistics.median(times[10:])
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--table", type=int, default=64, help="block-table entries per sequence (1024 tokens / 16)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_run, args=(_free_port(), batches, args.table, args.steps, q), nprocs=2)
    res = q.get()
    print(f"TP control path, 2 gloo ranks on CPU, {args.table}-entry tables, medians of {args.steps - 10} steps (ms)")
    print("| batch | pickled, whole tables | packed, table changes | ratio |")
    print("|---:|---:|---:|---:|")
    for B in batches:
        a, b = res[(B, "pickled")], res[(B, "packed")]
        print(f"| {B} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
