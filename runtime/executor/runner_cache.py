"""The runner's cache set-up (a ModelRunner base): the recurrent mixers' state pool, the KV-cache size (bytes per block,
the number of blocks that fit the memory budget) and the per-layer paged caches (attention layers, sparse-attention
indexers). Reads what ModelRunner.__init__ set: model, attn_layers, index_layers, block_size, max_num_seqs,
max_model_len, device, dtype, kv_dtype, num_kv_blocks.
"""
from __future__ import annotations

import gc

import torch

from xllm_gen.runtime import layers as L


class RunnerCacheSetup:
    def _allocate_state_pool(self) -> None:
        """The per-sequence state pool of the recurrent mixers (runtime/layers/recurrent/), beside the paged KV
        cache: one slot per sequence that may hold a state at once (max_num_seqs running, plus a prompt being
        prefilled in chunks). The block manager hands out the slots (num_state_slots)."""
        self.state_layers = [m for m in self.model.modules() if isinstance(m, L.RecurrentMixer)]
        self.num_state_slots = self.max_num_seqs + 1 if self.state_layers else 0
        # one more slot than the block manager hands out: the scratch slot, which the padding rows of a decode graph
        # bucket read and write, so that a padding row never touches a live sequence's state
        self.state_scratch_slot = self.num_state_slots if self.state_layers else None
        for m in self.state_layers:
            m.init_states(self.num_state_slots + 1, self.device, self.dtype)

    def _kv_bytes_per_block(self) -> int:
        if not self.attn_layers:        # no KV cache at all (a purely recurrent model): blocks are bookkeeping only
            return 1
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        # each layer at its own shape (KV heads, key and value head widths may differ between layers); the indexers'
        # key caches (model dtype) ride on the same blocks
        index_elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * (sum(layer.kv_bytes_per_token(elem) for layer in self.attn_layers)
                                  + sum(m.cache_bytes_per_token(index_elem) for m in self.index_layers))

    def _auto_num_blocks(self, gpu_memory_utilization: float) -> int:
        per_block = self._kv_bytes_per_block()
        worst = self.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        if self.device.type == "cuda":
            gc.collect()                       # an engine deleted in this process gives its memory back first
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * gpu_memory_utilization - used - 512 * 2**20   # headroom for activations/graphs
            blocks = min(worst, int(budget // per_block))
            one_seq = (self.max_model_len + self.block_size - 1) // self.block_size
            if blocks < one_seq:
                raise ValueError(
                    f"not enough GPU memory for the KV cache: {max(blocks, 0)} blocks of {self.block_size} tokens fit "
                    f"in gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB "
                    f"({used / 2**30:.1f} GiB already in use), one sequence of max_model_len={self.max_model_len} "
                    f"needs {one_seq}; lower max_model_len, raise gpu_memory_utilization, or free the GPU "
                    "(shut down other engines: LLM.shutdown() or `with LLM(...)`)")
            return blocks
        return max(16, min(worst, int(2 * 2**30 // per_block)))         # CPU: at most 2 GiB of KV

    def _allocate_kv_cache(self) -> None:
        for layer in self.attn_layers:     # each layer at its own shape: [blocks, block_size, KV heads, width]
            shape = (self.num_kv_blocks, self.block_size, layer.num_kv_heads)
            layer.k_cache = torch.zeros(shape + (layer.head_dim,), dtype=self.kv_dtype, device=self.device)
            layer.v_cache = torch.zeros(shape + (layer.v_head_dim,), dtype=self.kv_dtype, device=self.device)
        for m in self.index_layers:        # an indexer's keys: one [head_dim] per slot, the same blocks and slots
            # (a per-key score bias cache, runtime/layers/key_bias.py, sets its own width and dtype)
            m.k_cache = torch.zeros((self.num_kv_blocks, self.block_size, getattr(m, "cache_width", None) or m.head_dim),
                                    dtype=getattr(m, "cache_dtype", None) or self.dtype, device=self.device)
