"""The attention backends a decode CUDA-graph bucket runs (cuda_graph.py's DecodeGraphs): `_BucketAttention` (the
bucket's FlashInfer / Triton decode wrappers, planned once per step outside the graph, with a fast re-plan) and
`_EagerBucketAttention` (capture=False: the runner's own backend on the bucket's real rows)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from xllm_gen.runtime.attention.base import FULL, AttentionBackend, AttentionVariant
from xllm_gen.runtime.executor.context import ForwardContext


class _BucketAttention(AttentionBackend):
    """The attention backend seen by the layers inside one bucket's graph: the bucket's decode wrappers (FlashInfer's
    or the Triton kernel's), one per attention variant of the model (sliding window / soft-cap; a plain model has
    one), all planned once per step (outside the graph) by DecodeGraphs; each layer's forward picks its variant's.

    Re-planning: the first plan goes through each wrapper's `plan()` (a bucket on the Triton kernel: every
    step; its `plan()` copies indptr / last-page length into the bucket's persistent buffers). Later ones, for
    a bucket on FlashInfer in the configuration the decode graphs use (FlashInfer 0.6, tensor-core decode = fa2
    prefill kernels, CUDA-graph mode), do only what `plan()` does on a re-plan of the same bucket: copy indptr /
    last-page length into the persistent buffers (once: the variants' wrappers share them; the page indices are
    already in place) and run the
    scheduler (`module.plan`, with the variant's window_left) with the KV lengths computed here with numpy.
    This skips the wrapper's per-call Python work, among it a Python `max()` over a tensor of KV lengths
    (about 3 us per row: 0.35 ms per step at batch 112). Anything else, or XLLM_GRAPH_FAST_PLAN=0, keeps
    `plan()` every step."""

    def __init__(self, backend, wrappers, batch_size: int):
        self.backend = backend
        if not isinstance(wrappers, dict):                 # one wrapper: a model without variants
            wrappers = {FULL: wrappers}
        self.wrappers = {AttentionVariant(*v): w for v, w in wrappers.items()}
        self.wrapper = next(iter(self.wrappers.values()))
        self.batch_size = batch_size
        self._replan = None

    def plan(self, ctx: ForwardContext) -> None:         # pragma: no cover - DecodeGraphs plans directly
        raise RuntimeError("a graph bucket is planned by DecodeGraphs, not through plan(ctx)")

    def plan_decode(self, indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor) -> None:
        """indptr [B+1] / last_page_len [B]: int32 host tensors; indices: the step's pages, already in the
        wrappers' (shared) page-index buffer."""
        if self._replan is not None:
            self._replan(indptr, last_page_len)
            return
        be = self.backend
        for v, w in self.wrappers.items():
            w.plan(indptr, indices, last_page_len, be.num_heads, be.num_kv_heads, be.head_dim,
                   be.block_size, q_data_type=be.dtype, kv_data_type=getattr(be, "kv_dtype", be.dtype),
                   sm_scale=be.sm_scale, window_left=v.window_left, logits_soft_cap=v.logit_softcap)
        self._replan = self._fast_replan()

    def _fast_replan(self):
        import os
        try:
            import flashinfer
            version_ok = flashinfer.__version__.startswith("0.6.")
        except Exception:                                  # pragma: no cover
            version_ok = False
        attrs = ("_cached_module", "_plan_info", "_float_workspace_buffer", "_int_workspace_buffer",
                 "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf",
                 "_window_left")
        if not (version_ok and os.environ.get("XLLM_GRAPH_FAST_PLAN", "1") != "0"):
            return None
        for w in self.wrappers.values():
            if not (getattr(w, "_use_tensor_cores", False) and getattr(w, "_use_cuda_graph", False)
                    and getattr(w, "_backend", None) == "fa2" and getattr(w, "_jit_module", 0) is None
                    and all(hasattr(w, a) for a in attrs)):
                return None
        be = self.backend
        B, page = self.batch_size, be.block_size
        qo_indptr = torch.arange(B + 1, dtype=torch.int32)
        kv_lens = torch.empty(B, dtype=torch.int32)
        kv_np = kv_lens.numpy()
        # BatchDecodeWithPagedKVCacheWrapper.plan, tensor-core branch: total_num_rows, batch, heads, kv heads,
        # page size, cuda graph, head_dim qk / vo, causal, window_left; fa2: fixed_split_size, disable_split_kv,
        # num_colocated_ctas.
        plans = [(w, w._cached_module,
                  (B, B, be.num_heads, be.num_kv_heads, page, True, be.head_dim, be.head_dim, False,
                   int(w._window_left), -1, False, 0))
                 for w in self.wrappers.values()]
        # the persistent indptr / last-page-length buffers, each copied once per step (variants share them)
        buffers, seen = [], set()
        for w in self.wrappers.values():
            for buf, which in ((w._paged_kv_indptr_buf, 0), (w._paged_kv_last_page_len_buf, 1)):
                if id(buf) not in seen:
                    seen.add(id(buf))
                    buffers.append((buf, which))

        def replan(indptr: torch.Tensor, last_page_len: torch.Tensor) -> None:
            for buf, which in buffers:
                buf.copy_(last_page_len if which else indptr, non_blocking=True)
            ip = indptr.numpy()
            np.maximum(ip[1:] - ip[:-1] - 1, 0, out=kv_np)          # flashinfer.page.get_seq_lens
            np.multiply(kv_np, page, out=kv_np)
            np.add(kv_np, last_page_len.numpy(), out=kv_np)
            max_kv = int(kv_np.max())
            for w, module, tail in plans:
                w._max_kv_len = max_kv
                w._plan_info = module.plan(w._float_workspace_buffer, w._int_workspace_buffer,
                                           w._pin_memory_int_workspace_buffer, qo_indptr, indptr, kv_lens, *tail)
        return replan

    def decode_page_table(self, ctx: ForwardContext):
        """The bucket's persistent table (its padding rows without pages)."""
        from xllm_gen.runtime.attention.triton_decode import decode_page_table_of
        w = self.wrappers.get(FULL)
        return None if w is None else decode_page_table_of(w)

    takes_rope = True       # forward's `rope` (runtime/layers/attention.py)

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant: Optional[AttentionVariant] = None,
                k_scale=None, v_scale=None, sinks: Optional[torch.Tensor] = None, rope=None):
        w = self.wrappers.get(variant or FULL)
        if w is None:
            raise RuntimeError(f"decode graph bucket {self.batch_size} has no wrapper for attention variant "
                               f"{variant}: the backend was not given the model's variants before capture")
        if rope is not None:    # the q/k norm + rotary + KV store: in the Triton kernel's launch, else before it
            from xllm_gen.runtime.attention.flashinfer_run import run_attention
            from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper
            if isinstance(w, TritonDecodeWrapper):
                return run_attention(w, q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                     rope=rope)
            q, k = rope.apply(q, k_cache, v_cache)
        if k_scale is None and v_scale is None and sinks is None:
            return w.run(q, (k_cache, v_cache))
        # a scaled cache: per-tensor scales are constants of the captured launches (FlashInfer folds k_scale into the
        # kernel's softmax scale and multiplies the output by v_scale in place; the Triton kernel likewise); per-KV-head
        # ones (fixed tensors) and attention sinks (a parameter) are read by kernels captured around the wrapper's
        # (runtime/attention/flashinfer_run.py)
        from xllm_gen.runtime.attention.flashinfer_run import run_attention
        return run_attention(w, q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, sinks=sinks)


class _NoEvent:
    """Stands in for torch.cuda.Event off CUDA (capture=False on the CPU): host copies are synchronous there."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _EagerBucketAttention(AttentionBackend):
    """A bucket's attention when DecodeGraphs runs without capture: the runner's backend on the real rows of the
    step (rows with pages), its context rebuilt from the bucket's indptr / last-page lengths / page indices;
    padding rows get zeros."""

    def __init__(self, backend, batch_size: int, block_size: int, slots: torch.Tensor):
        self.backend, self.batch_size, self.block_size, self.slots = backend, batch_size, block_size, slots
        self.ctx: Optional[ForwardContext] = None
        self.rows = 0
        self.table = None

    def plan(self, ctx: ForwardContext) -> None:         # pragma: no cover - DecodeGraphs plans directly
        raise RuntimeError("a graph bucket is planned by DecodeGraphs, not through plan(ctx)")

    def plan_decode(self, indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor) -> None:
        ip, last = indptr.tolist(), last_page_len.tolist()
        pages = indices.cpu().tolist()
        bs = self.block_size
        lens = [(ip[i + 1] - ip[i] - 1) * bs + last[i] if ip[i + 1] > ip[i] else 0 for i in range(len(last))]
        B = sum(1 for n in lens if n > 0)
        if any(n > 0 for n in lens[B:]):
            raise RuntimeError(f"decode bucket {self.batch_size}: a padding row before a real row ({lens})")
        width = max([ip[i + 1] - ip[i] for i in range(B)] + [1])
        tables = torch.full((max(B, 1), width), -1, dtype=torch.int32)
        for i in range(B):
            tables[i, :ip[i + 1] - ip[i]] = torch.tensor(pages[ip[i]:ip[i + 1]], dtype=torch.int32)
        dev = self.slots.device
        self.table = tuple(t.to(dev, torch.int32) for t in (indptr, indices, last_page_len))
        self.rows = B
        self.ctx = ForwardContext(
            is_prefill=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens[:B], dtype=torch.int32, device=dev), slot_mapping=self.slots[:B],
            block_tables=tables[:B].to(dev), block_size=bs, seq_lens_cpu=lens[:B], query_lens_cpu=[1] * B,
            backend=self.backend)
        if B:
            self.backend.plan(self.ctx)

    def decode_page_table(self, ctx: ForwardContext):
        """The bucket's table as planned, padding rows included (without pages)."""
        return self.table

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant: Optional[AttentionVariant] = None, **kw):
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:])      # value heads may have a width of their own
        if self.rows:
            out[:self.rows] = self.backend.forward(q[:self.rows], k[:self.rows], v[:self.rows], k_cache, v_cache,
                                                   self.ctx, scale, variant=variant, **kw)
        return out
