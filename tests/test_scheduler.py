"""Scheduler, block manager and input preparation under stress, with a fake model that reads its input
back from a simulated paged KV cache: any wrong slot, block table, position or recompute after preemption
changes the tokens. Random pools, prompt lengths, chunk sizes, stop tokens and arrival order, with and without
async scheduling (greedy decode steps launched before the previous step's tokens are read: their inputs come from
the device); every request must end with the same tokens as a direct computation, and every block must be free
at the end."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from xllm_gen.runtime.engine.async_decode import AsyncDecode
from xllm_gen.runtime.engine.block_manager import BlockManager
from xllm_gen.runtime.engine.engine import LLMEngine
from xllm_gen.runtime.engine.sampler import Sampler, greedy_argmax
from xllm_gen.runtime.engine.sampling_params import SamplingParams
from xllm_gen.runtime.engine.scheduler import Scheduler
from xllm_gen.runtime.engine.sequence import Sequence
from xllm_gen.runtime.executor.model_runner import ModelRunner

VOCAB = 97


def next_token(tokens) -> int:
    return zlib.crc32(bytes(str(list(tokens)), "ascii")) % VOCAB


class PagedFakeRunner:
    """Writes each step's (token, position) at its KV slots, then rebuilds every sequence from the cache
    through its block table; the next token is a hash of what it read."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_kv_blocks = num_blocks
        self.prep = ModelRunner.__new__(ModelRunner)          # reuse the real input preparation
        self.prep.block_size, self.prep.device = block_size, torch.device("cpu")
        self.prep.backend = None
        self.cache: dict[int, tuple[int, int]] = {}
        self.bs = block_size
        self.async_steps = 0

    def run(self, seqs, is_prefill, all_rows=False, input_ids=None):
        ids, pos, ctx, _ = self.prep.prepare(seqs, is_prefill)
        if input_ids is not None:
            ids = input_ids
        for t, p, slot in zip(ids.tolist(), pos.tolist(), ctx.slot_mapping.tolist()):
            assert 0 <= slot < self.num_kv_blocks * self.bs
            self.cache[slot] = (t, p)
        logits = torch.full((len(seqs), VOCAB), -1.0)
        for i, seq in enumerate(seqs):
            n = int(ctx.seq_lens[i])
            table = ctx.block_tables[i].tolist()
            read = []
            for p in range(n):
                t, q = self.cache[table[p // self.bs] * self.bs + p % self.bs]
                assert q == p, f"slot of position {p} holds position {q}"
                read.append(t)
            known = min(n, seq.num_tokens)                       # the rest is still "on the device"
            assert read[:known] == seq.token_ids[:known], "the cache does not hold the sequence's tokens"
            assert n == seq.num_tokens_with_pending if not is_prefill else True
            logits[i, next_token(read)] = 1.0
        return logits

    def decode_greedy(self, seqs, prev_tokens=None, rows=None):
        self.async_steps += 1
        ids = None
        if prev_tokens is not None:
            ids = prev_tokens if rows is None else prev_tokens[torch.tensor(rows)]
        return greedy_argmax(self.run(seqs, False, input_ids=ids))


def make_engine(num_blocks, block_size, max_num_seqs, budget, chunked, max_model_len=4096, async_scheduling=False):
    eng = LLMEngine.__new__(LLMEngine)
    eng.runner = PagedFakeRunner(num_blocks, block_size)
    eng.block_manager = BlockManager(num_blocks, block_size)
    eng.scheduler = Scheduler(eng.block_manager, max_num_seqs, budget, chunked)
    eng.sampler = Sampler(0)
    eng.eos_token_ids, eng.tokenizer, eng.max_model_len = set(), None, max_model_len
    eng.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
    eng.vocab_size, eng.mm_processor, eng._next_id = VOCAB, None, 0
    eng.scheduler.fits_at_all = lambda n: -(-n // block_size) <= num_blocks
    eng._last_progress, eng._stream_text = [], False
    eng._async = AsyncDecode(eng.runner, max_num_seqs, torch.device("cpu")) if async_scheduling else None
    return eng


PREEMPTIONS: list[int] = []


ASYNC_STEPS: list[int] = []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_finish_with_exact_tokens(seed, async_scheduling):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    chunked = rng.random() < 0.5
    budget = rng.choice([3, 8, 64]) if chunked else 64
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(1, 30))
                for _ in range(rng.randint(1, 12))]
    longest = max(len(p) + m for p, m in requests)
    num_blocks = -(-longest // bs) + rng.randint(0, 3 * -(-longest // bs))     # tight to roomy pools
    stops = [set(rng.sample(range(VOCAB), 3)) if rng.random() < 0.4 else set() for _ in requests]
    eng = make_engine(num_blocks, bs, rng.choice([1, 3, 256]), budget, chunked, async_scheduling=async_scheduling)
    seqs = []
    pending = list(requests)
    steps = 0
    while pending or eng.scheduler.has_unfinished():
        for _ in range(rng.randint(0, 2) if eng.scheduler.has_unfinished() else 1):   # requests join mid-flight
            if pending:
                prompt, max_tokens = pending.pop(0)
                s = Sequence(len(seqs), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                               stop_token_ids=sorted(stops[len(seqs)])))
                eng.scheduler.add(s)
                seqs.append(s)
        if eng.scheduler.has_unfinished():
            eng.step()
        steps += 1
        assert steps < 5000, "no progress"
    for s, (prompt, max_tokens), stop in zip(seqs, requests, stops):
        want, reason = list(prompt), "length"
        for _ in range(max_tokens):
            want.append(next_token(want))
            if want[-1] in stop:
                reason = "stop"
                break
        assert s.token_ids == want, f"request {s.seq_id}: tokens differ (preemptions: {s.num_preemptions})"
        assert s.finish_reason == reason
        assert s.num_pending == 0 or s.finish_reason == "stop"      # a stopped one may end with a dropped row
    assert eng.block_manager.num_free_blocks == num_blocks
    assert len(set(eng.block_manager.free_blocks)) == num_blocks
    if async_scheduling:
        ASYNC_STEPS.append(eng.runner.async_steps)
    else:
        PREEMPTIONS.append(eng.scheduler.num_preemptions)


def test_the_random_workloads_did_preempt():
    """The battery above must exercise preemption and recompute, not only roomy pools."""
    assert len(PREEMPTIONS) == 24 and sum(1 for n in PREEMPTIONS if n) >= 5, PREEMPTIONS


def test_the_random_workloads_did_run_async():
    """... and the async arm must have launched decode steps ahead, not fallen back to synchronous steps."""
    assert len(ASYNC_STEPS) == 24 and sum(1 for n in ASYNC_STEPS if n) >= 18, ASYNC_STEPS
