"""FlashInfer paged attention (CUDA): one plan per step, shared by all layers.

KV cache layout NHD: each layer's (k_cache, v_cache) are [num_pages, page_size, Hk, D] (page = KV block).

Per step, `plan(ctx)` (outside any CUDA graph) picks and plans one wrapper:
- prefill without cached prefix (every query_len == seq_len): BatchPrefillWithRaggedKVCacheWrapper on the
  step's k/v directly (causal);
- prefill with a cached prefix (chunked prefill, prefix cache, mixed rows): BatchPrefillWithPagedKVCacheWrapper
  on the paged cache (causal, bottom-right aligned);
- decode (one query token per row): BatchDecodeWithPagedKVCacheWrapper (tensor cores when GQA). When the
  batch size equals a graph bucket, that bucket's wrapper is used: built with use_cuda_graph=True over
  persistent buffers (indptr [b+1], last_page_len [b] per bucket; one page-index buffer shared by all
  buckets, sized for the worst case), so a graph captured after a plan stays valid when later steps re-plan.
Padding rows of a captured batch are empty sequences: seq_len 0 -> no pages, index pointer repeated,
last-page length 1 (FlashInfer's kernels read a row with no pages as length 0). No dummy page is allocated.

The float workspace (shared by all wrappers; they never run concurrently) is sized from the model and the
batch limits by `FlashInferBackend.workspace_size`, after FlashInfer's split-KV planner (scheduler.cuh):
temporary outputs num_qo_heads * padded_batch * cta_tile_q * (head_dim + 1) floats, where
padded_batch <= max(2 * num_SMs / Hk, ceil(tokens * group / cta_tile_q) + batch).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from xllm_gen.runtime.attention.base import AttentionBackend
from xllm_gen.runtime.executor.context import ForwardContext


class FlashInferBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cuda", *, block_size: int = 16, max_batch: int = 256,
                 max_model_len: Optional[int] = None, max_num_blocks: Optional[int] = None,
                 max_num_tokens: int = 8192, graph_buckets: Sequence[int] = (),
                 sm_scale: Optional[float] = None, kv_dtype: Optional[torch.dtype] = None,
                 prefill_backend: str = "fa2", decode_tensor_cores: Optional[bool] = None,
                 workspace_bytes: Optional[int] = None):
        import flashinfer

        self.num_heads = num_heads                 # per rank
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch = max_batch
        # the shared page-index buffer: a decode batch never holds more pages than either bound
        bounds = []
        if max_model_len:
            bounds.append(max_batch * ((max_model_len + block_size - 1) // block_size))
        if max_num_blocks:
            bounds.append(max_num_blocks)
        self.max_pages = max(1, min(bounds) if bounds else max_batch * 256)
        self.sm_scale = float(sm_scale) if sm_scale is not None else head_dim ** -0.5
        if decode_tensor_cores is None:
            decode_tensor_cores = num_heads // num_kv_heads > 1
        self.decode_tensor_cores = decode_tensor_cores
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        ws = workspace_bytes or self.workspace_size(num_heads, num_kv_heads, head_dim, max(max_batch, 1),
                                                    max_num_tokens, num_sms)
        self.workspace_bytes = ws
        self.workspace = torch.zeros(ws, dtype=torch.uint8, device=self.device)
        self.prefill_ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD",
                                                                              backend=prefill_backend)
        self.prefill_paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                            backend=prefill_backend)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=decode_tensor_cores)
        # graph buckets: persistent index buffers
        self.page_indices_buf = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
        self.graph_buckets: tuple[int, ...] = ()
        self.graph_wrappers = {}
        self.graph_buffers = {}
        self.ensure_graph_buckets(graph_buckets)
        self._mode: Optional[str] = None
        self._wrapper = None
        self._ctx: Optional[ForwardContext] = None

    def ensure_graph_buckets(self, buckets: Sequence[int]) -> None:
        """Builds the CUDA-graph decode wrappers of `buckets` that do not exist yet (call before capture)."""
        import flashinfer
        for b in sorted(set(int(b) for b in buckets)):
            if b in self.graph_wrappers:
                continue
            if not 0 < b <= self.max_batch:
                raise ValueError(f"graph bucket {b} is outside 1..max_batch={self.max_batch}")
            indptr = torch.zeros(b + 1, dtype=torch.int32, device=self.device)
            last = torch.ones(b, dtype=torch.int32, device=self.device)
            self.graph_buffers[b] = (indptr, last)
            self.graph_wrappers[b] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self.page_indices_buf,
                paged_kv_last_page_len_buffer=last)
        self.graph_buckets = tuple(sorted(self.graph_wrappers))

    # ------------------------------------------------------------------------------------------ sizing
    @staticmethod
    def workspace_size(num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int, max_num_tokens: int,
                       num_sms: int = 132, cta_tile_q: int = 128) -> int:
        group = max(1, num_heads // num_kv_heads)
        tiles = 2 * num_sms // max(1, num_kv_heads) + max_batch + 1
        rows = cta_tile_q * tiles + max_num_tokens * group
        need = 4 * num_heads * (head_dim + 1) * rows
        return max(128 << 20, need + (16 << 20))

    # ------------------------------------------------------------------------------------------ planning
    def _page_table(self, ctx: ForwardContext, seq_lens: list[int]):
        bs = ctx.block_size
        npages = [(L + bs - 1) // bs for L in seq_lens]
        counts = torch.tensor(npages, dtype=torch.int32)
        indptr = torch.zeros(len(npages) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=indptr[1:])
        last = torch.tensor([L - (n - 1) * bs if n > 0 else 1 for L, n in zip(seq_lens, npages)], dtype=torch.int32)
        total = int(indptr[-1])
        bt_cpu = ctx.extra.get("block_tables_cpu") if ctx.extra else None
        if bt_cpu is not None:
            bt_cpu = torch.as_tensor(bt_cpu, dtype=torch.int32)
            idx = torch.cat([bt_cpu[i, :n] for i, n in enumerate(npages)]) if total else torch.zeros(0, dtype=torch.int32)
            indices = idx.to(self.device, non_blocking=True)
        else:
            rows = torch.repeat_interleave(torch.arange(len(npages)), counts.long())
            cols = torch.arange(total) - torch.repeat_interleave(indptr[:-1].long(), counts.long())
            bt = ctx.block_tables
            indices = bt[rows.to(bt.device, non_blocking=True), cols.to(bt.device, non_blocking=True)].to(torch.int32)
        return indptr, indices, last

    def plan(self, ctx: ForwardContext) -> None:
        seq_lens = list(ctx.seq_lens_cpu) if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        if ctx.query_lens_cpu is not None:
            q_lens = list(ctx.query_lens_cpu)
        else:
            cu = ctx.cu_seqlens_q.tolist()
            q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        decode = not ctx.is_prefill
        if decode and any(q != 1 for q in q_lens):
            raise ValueError("a decode step has one query token per row")
        if not decode and all(q == L for q, L in zip(q_lens, seq_lens)):
            self.prefill_ragged.plan(qo_indptr, qo_indptr, H, Hk, D, causal=True, sm_scale=self.sm_scale,
                                     q_data_type=self.dtype, kv_data_type=self.dtype)
            self._mode, self._wrapper = "ragged", self.prefill_ragged
        else:
            indptr, indices, last = self._page_table(ctx, seq_lens)
            if decode:
                B = len(q_lens)
                wrapper = self.graph_wrappers.get(B, self.decode)
                wrapper.plan(indptr, indices, last, H, Hk, D, ctx.block_size, q_data_type=self.dtype,
                             kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)
                self._mode, self._wrapper = "decode", wrapper
            else:
                self.prefill_paged.plan(qo_indptr, indptr, indices, last, H, Hk, D, ctx.block_size, causal=True,
                                        sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
                self._mode, self._wrapper = "paged_prefill", self.prefill_paged
        self._ctx = ctx

    # ------------------------------------------------------------------------------------------ running
    def forward(self, q, k, v, k_cache, v_cache, ctx, scale):
        if self._wrapper is None:
            raise RuntimeError("FlashInferBackend.forward before plan(ctx)")
        if abs(scale - self.sm_scale) > 1e-9 * max(1.0, abs(scale)):
            raise ValueError(f"attention scale {scale} differs from the planned one {self.sm_scale}")
        if self._mode == "ragged":
            return self._wrapper.run(q, k.contiguous(), v.contiguous())
        return self._wrapper.run(q, (k_cache, v_cache))
