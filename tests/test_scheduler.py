"""Scheduler, block manager and input preparation under stress, with a fake model that reads its input
back from a simulated paged KV cache: any wrong slot, block table, position or recompute after preemption
changes the tokens. Random pools, prompt lengths, chunk sizes and arrival order; every request must end
with the same tokens as a direct computation, and every block must be free at the end."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from xllm_gen.runtime.engine.block_manager import BlockManager
from xllm_gen.runtime.engine.engine import LLMEngine
from xllm_gen.runtime.engine.sampler import Sampler
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

    def run(self, seqs, is_prefill, all_rows=False):
        ids, pos, ctx, _ = self.prep.prepare(seqs, is_prefill)
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
            assert read == seq.token_ids[:n], "the cache does not hold the sequence's tokens"
            logits[i, next_token(read)] = 1.0
        return logits


def make_engine(num_blocks, block_size, max_num_seqs, budget, chunked, max_model_len=4096):
    eng = LLMEngine.__new__(LLMEngine)
    eng.runner = PagedFakeRunner(num_blocks, block_size)
    eng.block_manager = BlockManager(num_blocks, block_size)
    eng.scheduler = Scheduler(eng.block_manager, max_num_seqs, budget, chunked)
    eng.sampler = Sampler(0)
    eng.eos_token_ids, eng.tokenizer, eng.max_model_len = set(), None, max_model_len
    eng.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
    eng.vocab_size, eng.mm_processor, eng._next_id = VOCAB, None, 0
    eng.scheduler.fits_at_all = lambda n: -(-n // block_size) <= num_blocks
    return eng


PREEMPTIONS: list[int] = []


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_finish_with_exact_tokens(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    chunked = rng.random() < 0.5
    budget = rng.choice([3, 8, 64]) if chunked else 64
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(1, 30))
                for _ in range(rng.randint(1, 12))]
    longest = max(len(p) + m for p, m in requests)
    num_blocks = -(-longest // bs) + rng.randint(0, 3 * -(-longest // bs))     # tight to roomy pools
    eng = make_engine(num_blocks, bs, rng.choice([1, 3, 256]), budget, chunked)
    seqs = []
    pending = list(requests)
    steps = 0
    while pending or eng.scheduler.has_unfinished():
        for _ in range(rng.randint(0, 2) if eng.scheduler.has_unfinished() else 1):   # requests join mid-flight
            if pending:
                prompt, max_tokens = pending.pop(0)
                s = Sequence(len(seqs), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                eng.scheduler.add(s)
                seqs.append(s)
        if eng.scheduler.has_unfinished():
            eng.step()
        steps += 1
        assert steps < 5000, "no progress"
    for s, (prompt, max_tokens) in zip(seqs, requests):
        want = list(prompt)
        for _ in range(max_tokens):
            want.append(next_token(want))
        assert s.token_ids == want, f"request {s.seq_id}: tokens differ (preemptions: {s.num_preemptions})"
        assert s.finish_reason == "length"
    assert eng.block_manager.num_free_blocks == num_blocks
    assert len(set(eng.block_manager.free_blocks)) == num_blocks
    PREEMPTIONS.append(eng.scheduler.num_preemptions)


def test_the_random_workloads_did_preempt():
    """The battery above must exercise preemption and recompute, not only roomy pools."""
    assert len(PREEMPTIONS) == 24 and sum(1 for n in PREEMPTIONS if n) >= 5, PREEMPTIONS
