"""Paged KV cache bookkeeping: a pool of fixed-size blocks and one block table per sequence."""
from __future__ import annotations

from collections import deque

from xllm_gen.runtime.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have KV slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("KV cache out of blocks (the scheduler should have preempted)")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        # Returned to the front: recently used blocks are reused first.
        for b in reversed(seq.block_table):
            self.free_blocks.appendleft(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
