"""The TP control channel (runtime/executor/tp_worker.py): a step travels packed in int64, its block tables as
changes. Round trips of random steps; a step with multimodal inputs is not packed (it is pickled); and a worker's
mirror that applies rank 0's step messages holds exactly rank 0's sequences after growth, an unchanged table,
a replaced table (preemption) and drops. The multi-process path is covered by test_tp.py / test_tp_faults.py."""
from __future__ import annotations

import random

import numpy as np

from xllm_gen.runtime.engine.sequence import Sequence, SequenceStatus
from xllm_gen.runtime.executor.tp_worker import _Mirror, pack_step, unpack_step


def _random_step(rng: random.Random):
    drops = [rng.randrange(10**9) for _ in range(rng.randint(0, 3))]
    items = []
    for _ in range(rng.randint(0, 40)):
        new = [rng.randrange(200_000) for _ in range(rng.choice([0, 1, 1, 7, 300]))]
        tail = [rng.randrange(10**6) for _ in range(rng.choice([0, 0, 1, 64]))]
        items.append((rng.randrange(2**40), rng.randrange(5000), new, rng.randrange(5000), rng.randrange(100), tail,
                      rng.randrange(5000), rng.randrange(5000), None, rng.choice([-1, rng.randrange(300)])))
    return rng.random() < 0.5, rng.random() < 0.5, drops, items


def test_pack_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        step = _random_step(rng)
        packed = pack_step(*step)
        assert packed.dtype == np.int64
        assert unpack_step(packed) == ("step", *step)


def test_a_step_with_images_or_non_integers_is_not_packed():
    items = [(1, 0, [5, 6], 2, 0, [3], 0, 2, ("mm",), -1)]
    assert pack_step(True, False, [], items) is None
    assert pack_step(True, False, [], [("req-1", 0, [5], 1, 0, [3], 0, 1, None, -1)]) is None
    assert pack_step(True, False, [2**70], []) is None


def test_mirror_follows_rank0_through_table_changes():
    from xllm_gen.runtime.executor.tp import TensorParallelRunner

    class _Rank0:                      # the part of TensorParallelRunner that builds step messages
        _step_message = TensorParallelRunner._step_message

        def __init__(self):
            self._sent = {}

    rank0, mirror = _Rank0(), _Mirror()
    a, b = Sequence(1, [1, 2, 3], None), Sequence(2, [4, 5], None)
    a.block_table, b.block_table = [7], [9, 10]
    b.state_slot = 3                   # a recurrent-state slot travels with the sequence (a has none: -1)
    sizes = []

    def step(seqs):
        msg, commit = rank0._step_message(seqs, False, False)
        packed = pack_step(*msg[1:])
        sizes.append(packed.size)
        got = mirror.apply(*unpack_step(packed)[3:])
        commit()
        for s, m in zip(seqs, got):
            assert (m.seq_id, m.token_ids, m.block_table, m.state_slot) == (s.seq_id, s.token_ids, s.block_table,
                                                                            s.state_slot)

    step([a, b])                       # first sight: whole tables
    a.token_ids.append(8)
    step([a, b])                       # unchanged tables: no table entries sent
    assert sizes[-1] == 4 + 2 * 9 + 1  # header, two items, one new token
    a.block_table.append(11)           # grew
    step([a, b])
    b.block_table = [20, 21]           # replaced (a preempted and re-admitted sequence)
    step([a, b])
    step([b])                          # a finished elsewhere: still held (not finished) ...
    a.status = SequenceStatus.FINISHED
    step([b])                          # ... dropped once finished
    assert sorted(mirror.seqs) == [2]
