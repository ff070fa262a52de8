"""Continuous batching: each step is either a prefill batch (new or resumed requests, possibly one chunk
of a long prompt) or a decode batch of all running requests. When KV blocks run out during decode, the
most recently admitted request is preempted: its blocks are freed and it is recomputed later from its
prompt plus the tokens it already generated, so its output is unchanged."""
from __future__ import annotations

from collections import deque

from xllm_gen.runtime.engine.block_manager import BlockManager, blocks_for
from xllm_gen.runtime.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.finished_by_capacity: list[Sequence] = []   # ended with "length": longer than the KV cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        scheduled = self._schedule_decode()
        if scheduled or not self.waiting:
            return scheduled, False
        # Decode preempted every running request: the blocks it freed let the waiting head go on.
        return self._schedule_prefill(), True

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        while self.waiting and len(scheduled) + len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_table and seq.num_computed_tokens == 0
            hit = bm.acquire_prefix(seq) if fresh else 0      # cached prefix blocks (prefix caching)
            remaining = seq.num_tokens - seq.num_computed_tokens
            if self.chunked_prefill:
                n = min(remaining, budget)
            else:
                n = remaining
                if n > budget and scheduled:   # whole prompts: the first one always fits
                    self._release_prefix(seq, hit)
                    break
            if n <= 0 or not bm.can_allocate(seq, seq.num_computed_tokens + n):
                self._release_prefix(seq, hit)
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            if fresh and bm.enable_caching:
                bm.prefix_queries += seq.num_tokens
                bm.prefix_hits += hit
            seq.chunk_len = n
            budget -= n
            scheduled.append(seq)
            if seq.num_computed_tokens + n < seq.num_tokens:
                break                          # a partial chunk: this sequence stays at the queue head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if budget <= 0:
                break
        return scheduled

    def _release_prefix(self, seq: Sequence, hit: int) -> None:
        """Undoes acquire_prefix for a sequence that stays waiting (its blocks go back to the cache)."""
        if hit:
            self.block_manager.free(seq)
            if seq.num_completion_tokens == 0:
                seq.num_cached_tokens = 0

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        bm = self.block_manager
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_allocate(seq, seq.num_tokens_with_pending):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.allocate(seq, seq.num_tokens_with_pending)
                seq.chunk_len = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def schedule_ahead(self, seqs: list[Sequence]) -> bool:
        """Async decode: the KV slot of one more token for each of `seqs` (running, their last token still on
        the device), when nothing waits and the free blocks suffice. False when this needs the scheduler's
        choices (admitting a prefill, preempting): the caller reads the tokens back and calls schedule()."""
        bm = self.block_manager
        if self.waiting or sum(bm.blocks_needed(s, s.num_tokens_with_pending) for s in seqs) > bm.num_free_blocks:
            return False
        for seq in seqs:
            bm.allocate(seq, seq.num_tokens_with_pending)
            seq.chunk_len = 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.free(seq)
        if not self.fits_at_all(seq.num_tokens):
            # It has outgrown the whole KV cache: it could never be resumed, so it ends here.
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "length"
            self.finished_by_capacity.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        # Back to the front of the queue, but behind a half-prefilled head: that one holds blocks and must
        # finish its prompt first, or neither could make progress in a small pool.
        if self.waiting and self.waiting[0].num_computed_tokens > 0:
            self.waiting.insert(1, seq)
        else:
            self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def take_finished_by_capacity(self) -> list[Sequence]:
        done, self.finished_by_capacity = self.finished_by_capacity, []
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)

    def fits_at_all(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_manager.block_size) <= self.block_manager.num_blocks
