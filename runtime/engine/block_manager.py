"""Paged KV cache bookkeeping: a pool of fixed-size blocks and one block table per sequence, with automatic
prefix caching (when enabled).

Prefix caching: a block whose tokens are all computed gets a hash chained over the whole token prefix up to
its end (and over the image content of a multimodal prompt, so equal placeholder tokens with other images
never match). A new (or resumed) sequence takes the longest run of cached full blocks of its prefix, keeping
at least one token to compute, and starts its prefill after them. Blocks are reference-counted; a block no
sequence uses stays cached in the free pool and is evicted least-recently-freed first when a new block is
needed. Without caching the pool behaves as before: the most recently freed blocks are reused first."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Optional

from xllm_gen.runtime.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _extra_key(seq: Sequence) -> bytes:
    """Content that the KV depends on besides the token ids: the images and videos of a multimodal prompt."""
    key = getattr(seq, "_prefix_extra", None)
    if key is None:
        mm = seq.mm_inputs
        h = hashlib.blake2b(digest_size=16)
        digest = mm.source_digest() if mm is not None and hasattr(mm, "source_digest") else None
        if digest is not None:         # pixel rows on the device: the digest of their raw inputs, no copy back
            h.update(digest)
        elif mm is not None:
            for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                t = getattr(mm, name, None)
                if t is not None:
                    h.update(name.encode())
                    h.update(str(tuple(t.shape)).encode())
                    h.update(t.detach().cpu().contiguous().numpy().tobytes())
        key = h.digest() if mm is not None else b""
        seq._prefix_extra = key
    return key


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_state_slots: int = 0):
        self.num_blocks = num_blocks
        # the recurrent-state pool (models with recurrent layers): a sequence takes a slot with its first blocks and
        # gives it back with them (finish, abort, preemption: a recomputed sequence starts from a zero state)
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # front: next used
        self.ref_count = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}          # prefix hash -> block holding that prefix's last block
        self.prefix_queries = 0                    # prompt tokens looked up / found (for the hit rate)
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have KV slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.num_state_slots and seq.state_slot is None and not self.free_slots:
            return False
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def _take_free(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:                           # evict its cached prefix
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
        self.ref_count[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("KV cache out of blocks (the scheduler should have preempted)")
        if self.num_state_slots and seq.state_slot is None:
            if not self.free_slots:
                raise RuntimeError("recurrent-state pool out of slots (the scheduler should have waited)")
            seq.state_slot = self.free_slots.pop()
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that a sequence's head blocks are evicted last.
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] > 0:
                continue
            self.free_blocks[b] = None
            if self.block_hash[b] is None:
                self.free_blocks.move_to_end(b, last=False)      # nothing cached: reused first
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the sequence's blocks past its first `num_tokens` tokens (speculative decoding: the blocks
        taken for drafts that were rejected). Those blocks hold no cached prefix (never full of committed
        tokens)."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_blocks[b] = None
                if self.block_hash[b] is None:
                    self.free_blocks.move_to_end(b, last=False)

    # ---- prefix caching ---------------------------------------------------------------------------
    def _cacheable(self, seq: Sequence) -> bool:
        return self.enable_caching and not getattr(seq, "no_prefix_cache", False)

    def _hash(self, seq: Sequence, i: int, parent: bytes) -> bytes:
        bs = self.block_size
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(_extra_key(seq))
        ids = seq.token_ids[i * bs:(i + 1) * bs]
        h.update(struct.pack(f"<{len(ids)}q", *ids))      # (per token in Python: ~1.7 us a token at admission)
        return h.digest()

    def acquire_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks: takes the cached blocks of its longest cached prefix (at least one
        token is left to compute); sets its computed tokens; returns how many tokens were found."""
        if not self._cacheable(seq) or seq.block_table or seq.num_computed_tokens:
            return 0
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        parent, table, hashes = b"", [], []
        for i in range(limit):
            h = self._hash(seq, i, parent)
            b = self.cached.get(h)
            if b is None:
                break
            table.append(b)
            hashes.append(h)
            parent = h
        for b in table:
            if self.ref_count[b] == 0:
                del self.free_blocks[b]
            self.ref_count[b] += 1
        seq.block_table = table
        seq.num_computed_tokens = len(table) * bs
        seq.num_hashed_blocks = len(table)
        seq._block_hashes = hashes
        if seq.num_cached_tokens == 0 and seq.num_completion_tokens == 0:
            seq.num_cached_tokens = len(table) * bs
        return len(table) * bs

    def commit(self, seq: Sequence) -> None:
        """Registers the sequence's blocks that are now full of computed tokens."""
        if not self._cacheable(seq):
            return
        bs = self.block_size
        done = getattr(seq, "num_hashed_blocks", 0)
        hashes = getattr(seq, "_block_hashes", None)
        if hashes is None or done == 0:
            hashes = seq._block_hashes = []
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(done, full):
            h = self._hash(seq, i, hashes[i - 1] if i else b"")
            hashes.append(h)
            b = seq.block_table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
        seq.num_hashed_blocks = max(done, full)
