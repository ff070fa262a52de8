"""FlashInfer paged attention (CUDA): one plan per step, shared by all layers.

KV cache layout NHD: each layer's (k_cache, v_cache) are [num_pages, page_size, Hk, D] (page = KV block).

Per step, `plan(ctx)` (outside any CUDA graph) picks one kind of wrapper and plans it once per attention variant
(AttentionVariant: sliding window -> window_left = W - 1, logit soft-cap -> logits_soft_cap; each variant has
its own wrappers, all over the one float workspace, which they never use concurrently; attention sinks and
per-KV-head KV-cache scales are computed around the wrapper's run, attention/flashinfer_run.py):
- prefill without cached prefix (every query_len == seq_len): BatchPrefillWithRaggedKVCacheWrapper on the
  step's k/v directly (causal);
  (the prefill wrappers use FlashInfer's fa2 kernels unless `prefill_attention_choice` says fa3 / auto);
- prefill with a cached prefix (chunked prefill, prefix cache, mixed rows): BatchPrefillWithPagedKVCacheWrapper
  on the paged cache (causal, bottom-right aligned);
- decode (one query token per row): BatchDecodeWithPagedKVCacheWrapper (tensor cores when GQA), or for small
  batches the Triton split-KV kernel that merges its splits in the same launch (attention/triton_decode.py,
  `decode_kernel`: "auto" / "flashinfer" / "triton", or $XLLM_DECODE_ATTENTION; "auto" times both for each
  graph bucket where the Triton kernel is a candidate, once per process, and keeps the faster). A decode batch
  takes the kernel (and split count) of the graph bucket it pads to, in graphs and eager steps alike, so both
  compute the same. When the batch size equals a graph bucket, that bucket's wrapper is used: built with
  use_cuda_graph=True over persistent buffers (indptr [b+1], last_page_len [b] per bucket; one page-index
  buffer shared by all buckets, sized for the worst case), so a graph captured after a plan stays valid when
  later steps re-plan.
Variants: those given to the constructor (`variants`, default FULL only) and `add_variants(...)` (DecodeGraphs
adds the model's before capture) are planned every step; a layer whose variant is not registered yet is
planned on its first use in an eager step (never inside a graph capture) and registered from then on. Each
layer's forward picks its variant's plan. The `prefill_ragged` / `prefill_paged` / `decode` / `graph_wrappers`
attributes are the first variant's wrappers; `variant_graph_wrappers[variant][bucket]` holds them all.
Padding rows of a captured batch are empty sequences: seq_len 0 -> no pages, index pointer repeated,
last-page length 1 (FlashInfer's kernels read a row with no pages as length 0). No dummy page is allocated.

The float workspace (shared by all wrappers; they never run concurrently) is sized from the model and the
batch limits by `FlashInferBackend.workspace_size`, after FlashInfer's split-KV planner (scheduler.cuh):
temporary outputs num_qo_heads * padded_batch * cta_tile_q * (head_dim + 1) floats, where
padded_batch <= max(2 * num_SMs / Hk, ceil(tokens * group / cta_tile_q) + batch).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from xllm_gen.runtime.attention import triton_decode
from xllm_gen.runtime.attention.base import FULL, AttentionBackend, AttentionVariant, cuda_attention_refusal
from xllm_gen.runtime.attention.flashinfer_run import run_attention
from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper, decode_kernel_choice, decode_splits
from xllm_gen.runtime.executor.context import ForwardContext


class _VariantWrappers:
    """One attention variant's wrappers: ragged / paged prefill, eager decode, and the CUDA-graph decode wrapper
    of each bucket (over the bucket's persistent indptr / last-page-length buffers, shared by all variants)."""

    def __init__(self, backend: "FlashInferBackend", variant: AttentionVariant):
        import flashinfer
        ws = backend.workspace
        self.variant = variant
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend.prefill_backend)
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend.prefill_backend)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                                    use_tensor_cores=backend.decode_tensor_cores)
        self.graph: dict = {}
        self.triton_eager: dict = {}               # (splits, BLOCK_N, warps) -> TritonDecodeWrapper (eager steps)


PREFILL_BACKENDS = ("fa2", "fa3", "auto")


def prefill_attention_choice(backend: Optional[str] = None) -> str:
    """FlashInfer's prefill kernel family: `backend` if given, else $XLLM_PREFILL_ATTENTION, else "fa2" (fa3: the
    Hopper kernels; "auto": FlashInfer picks by device)."""
    b = (backend or os.environ.get("XLLM_PREFILL_ATTENTION") or "fa2").lower()
    if b not in PREFILL_BACKENDS:
        raise ValueError(f"prefill attention backend must be one of {PREFILL_BACKENDS}, got {b!r} "
                         "(debug prefill_attention or $XLLM_PREFILL_ATTENTION)")
    return b


class FlashInferBackend(AttentionBackend):
    takes_rope = True       # forward's `rope`: a decode step's q/k norm + rotary + KV store (runtime/layers/attention.py)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cuda", *, block_size: int = 16, max_batch: int = 256,
                 max_model_len: Optional[int] = None, max_num_blocks: Optional[int] = None,
                 max_num_tokens: int = 8192, graph_buckets: Sequence[int] = (),
                 sm_scale: Optional[float] = None, kv_dtype: Optional[torch.dtype] = None,
                 prefill_backend: str = "fa2", decode_tensor_cores: Optional[bool] = None,
                 decode_kernel: Optional[str] = None, workspace_bytes: Optional[int] = None,
                 variants: Optional[Sequence[AttentionVariant]] = None, workspace: Optional[torch.Tensor] = None):
        # workspace: a float workspace to share (uint8, at least workspace_size(...) bytes): the backends of a model's
        # attention shape groups (runtime/attention/shape_groups.py) run one after another and share one
        self.num_heads = num_heads                 # per rank
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch = max_batch
        self.prefill_backend = prefill_backend
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
        self.num_sms = num_sms
        self.decode_kernel = decode_kernel_choice(decode_kernel)
        self.max_model_len = max_model_len
        self.decode_kernel_times: dict = {}        # bucket -> {splits (0: FlashInfer): us} of what was measured
        if workspace is not None:
            self.workspace, self.workspace_bytes = workspace, workspace.numel()
        else:
            ws = workspace_bytes or self.workspace_size(num_heads, num_kv_heads, head_dim, max(max_batch, 1),
                                                        max_num_tokens, num_sms)
            self.workspace_bytes = ws
            self.workspace = torch.zeros(ws, dtype=torch.uint8, device=self.device)
        # graph buckets: persistent index buffers (per bucket, shared by the variants' wrappers)
        self.page_indices_buf = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
        self.graph_buckets: tuple[int, ...] = ()
        self.graph_buffers = {}
        self._sets: dict[AttentionVariant, _VariantWrappers] = {}
        self.variants: tuple[AttentionVariant, ...] = ()
        self.add_variants(tuple(variants) if variants else (FULL,))
        self.ensure_graph_buckets(graph_buckets)
        self._mode: Optional[str] = None
        self._wrapper = None
        self._plans: dict = {}
        self._plan_inputs = None
        self._ctx: Optional[ForwardContext] = None

    # ---- the first variant's wrappers (what a plain model uses) ----------------------------------------
    @property
    def prefill_ragged(self):
        return self._sets[self.variants[0]].ragged

    @property
    def prefill_paged(self):
        return self._sets[self.variants[0]].paged

    @property
    def decode(self):
        return self._sets[self.variants[0]].decode

    @property
    def graph_wrappers(self) -> dict:
        return self._sets[self.variants[0]].graph

    @property
    def variant_graph_wrappers(self) -> dict:
        """{variant: {bucket: CUDA-graph decode wrapper}}."""
        return {v: self._sets[v].graph for v in self.variants}

    def add_variants(self, variants: Sequence[AttentionVariant]) -> None:
        """Registers attention variants (each gets its wrappers, graph ones for every bucket); registered
        variants are planned every step. Call before capturing graphs that use them."""
        for v in variants:
            v = AttentionVariant(*v)
            if v.chunk_size is not None:     # the loader refuses it first (cuda_attention_refusal); never run wrong
                raise NotImplementedError(cuda_attention_refusal((), chunked=True))
            if v in self._sets:
                continue
            self._sets[v] = _VariantWrappers(self, v)
            self.variants = self.variants + (v,)
            self._make_graph_wrappers(v, self.graph_buckets)

    def decode_splits(self, batch: int) -> int:
        """The Triton decode kernel's split count for a decode batch of `batch` rows (that of the graph bucket
        it pads to, if any); 0: FlashInfer's decode."""
        bucket = next((b for b in self.graph_buckets if b >= batch), None)
        if bucket is None:       # no graph bucket: "auto" measures buckets only, and keeps FlashInfer here
            return 0 if self.decode_kernel == "auto" else decode_splits(batch, self.num_kv_heads, self.num_sms,
                                                                        self.decode_kernel)
        return self._bucket_splits(bucket)

    def _bucket_splits(self, bucket: int) -> int:
        return self._bucket_launch(bucket)[0]

    def _bucket_launch(self, bucket: int) -> tuple[int, int, int]:
        """A graph bucket's kernel as (splits, BLOCK_N, num_warps), splits 0: FlashInfer's. Forced by decode_kernel,
        or ("auto") the faster of FlashInfer and the Triton kernel where the Triton kernel is a candidate, measured
        once per process (triton_decode)."""
        if self.decode_kernel != "auto" or not decode_splits(bucket, self.num_kv_heads, self.num_sms, "auto"):
            return triton_decode.launch_of(decode_splits(bucket, self.num_kv_heads, self.num_sms, self.decode_kernel),
                                           self.kv_dtype)
        contexts = tuple(triton_decode.tune_contexts(bucket, self.max_model_len))
        key = (bucket, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.kv_dtype, self.block_size,
               contexts)
        if key not in triton_decode.DECODE_KERNEL_CHOICE:
            try:   # timed at a 1k context, and at a long one where the engine admits it (combined: triton_decode)
                times = triton_decode.combine_timings([triton_decode.measure_decode_kernels(
                    bucket, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.kv_dtype,
                    self.block_size, context, self.device, self.workspace, self.decode_tensor_cores,
                    triton_decode.split_candidates(bucket, self.num_kv_heads, self.num_sms)) for context in contexts])
                choice = triton_decode.pick_decode_kernel(times, kv_dtype=self.kv_dtype)
            except torch.OutOfMemoryError:     # no room for the timing caches: the candidate rule's choice
                times, choice = {}, decode_splits(bucket, self.num_kv_heads, self.num_sms, "auto")
            triton_decode.DECODE_KERNEL_CHOICE[key] = choice
            self.decode_kernel_times[bucket] = times
        return triton_decode.launch_of(triton_decode.DECODE_KERNEL_CHOICE[key], self.kv_dtype)

    def _make_graph_wrappers(self, variant: AttentionVariant, buckets: Sequence[int]) -> None:
        import flashinfer
        graph = self._sets[variant].graph
        for b in buckets:
            if b in graph:
                continue
            indptr, last = self.graph_buffers[b]
            splits, block_n, num_warps = self._bucket_launch(b)
            if splits:
                graph[b] = TritonDecodeWrapper(self.num_heads, self.num_kv_heads, self.head_dim, splits, b,
                                               self.device, buffers=(indptr, last, self.page_indices_buf),
                                               block_n=block_n, num_warps=num_warps)
                continue
            graph[b] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self.page_indices_buf,
                paged_kv_last_page_len_buffer=last)

    def ensure_graph_buckets(self, buckets: Sequence[int]) -> None:
        """Builds the CUDA-graph decode wrappers of `buckets` that do not exist yet, for every registered
        variant (call before capture)."""
        for b in sorted(set(int(b) for b in buckets)):
            if b in self.graph_buffers:
                continue
            if not 0 < b <= self.max_batch:
                raise ValueError(f"graph bucket {b} is outside 1..max_batch={self.max_batch}")
            indptr = torch.zeros(b + 1, dtype=torch.int32, device=self.device)
            last = torch.ones(b, dtype=torch.int32, device=self.device)
            self.graph_buffers[b] = (indptr, last)
        self.graph_buckets = tuple(sorted(self.graph_buffers))
        for v in self.variants:
            self._make_graph_wrappers(v, self.graph_buckets)

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
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        decode = not ctx.is_prefill
        if decode and any(q != 1 for q in q_lens):
            raise ValueError("a decode step has one query token per row")
        # a float8 cache: prefill reads the rounded K / V back from the cache as decode does (the torch reference's
        # semantics), not this step's unrounded ones
        if not decode and self.kv_dtype == self.dtype and all(q == L for q, L in zip(q_lens, seq_lens)):
            self._mode, self._plan_inputs = "ragged", (qo_indptr,)
        else:
            indptr, indices, last = self._page_table(ctx, seq_lens)
            self._mode = "decode" if decode else "paged_prefill"
            self._plan_inputs = (qo_indptr, indptr, indices, last, ctx.block_size)
        self._ctx = ctx
        self._plans = {}
        for v in self.variants:
            self._plan_variant(v)
        self._wrapper = self._plans[self.variants[0]]

    def _plan_variant(self, v: AttentionVariant):
        """Plans variant v's wrapper of the step's mode (inputs from plan(ctx)); returns it."""
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        ws = self._sets[v]
        kw = dict(sm_scale=self.sm_scale, window_left=v.window_left, logits_soft_cap=v.logit_softcap)
        if self._mode == "ragged":
            (qo_indptr,) = self._plan_inputs
            ws.ragged.plan(qo_indptr, qo_indptr, H, Hk, D, causal=True, q_data_type=self.dtype,
                           kv_data_type=self.dtype, **kw)
            wrapper = ws.ragged
        else:
            qo_indptr, indptr, indices, last, page = self._plan_inputs
            if self._mode == "decode":
                wrapper = self._decode_wrapper(ws, len(last))
                wrapper.plan(indptr, indices, last, H, Hk, D, page, q_data_type=self.dtype,
                             kv_data_type=self.kv_dtype, **kw)
            else:
                wrapper = ws.paged
                wrapper.plan(qo_indptr, indptr, indices, last, H, Hk, D, page, causal=True,
                             q_data_type=self.dtype, kv_data_type=self.kv_dtype, **kw)
        self._plans[v] = wrapper
        return wrapper

    def _decode_wrapper(self, ws: _VariantWrappers, batch: int):
        """A decode step's wrapper: the bucket's own at a bucket size (so a graph captured after this plan reads
        its persistent buffers), else the kernel of the bucket the batch pads to (Triton: an eager wrapper with
        that bucket's split count; FlashInfer: the eager wrapper)."""
        if batch in ws.graph:
            return ws.graph[batch]
        bucket = next((b for b in self.graph_buckets if b >= batch), None)
        launch = self._bucket_launch(bucket) if bucket is not None else \
            triton_decode.launch_of(self.decode_splits(batch), self.kv_dtype)
        if not launch[0]:
            return ws.decode
        wrapper = ws.triton_eager.get(launch)
        if wrapper is None:
            wrapper = ws.triton_eager[launch] = TritonDecodeWrapper(
                self.num_heads, self.num_kv_heads, self.head_dim, launch[0], batch, self.device, block_n=launch[1],
                num_warps=launch[2])
        return wrapper

    def decode_page_table(self, ctx):
        """The page table this decode step's wrapper (FULL variant) was planned with; None outside a decode step."""
        wrapper = self._plans.get(FULL) if self._mode == "decode" else None
        return None if wrapper is None else triton_decode.decode_page_table_of(wrapper)

    # ------------------------------------------------------------------------------------------ running
    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant: Optional[AttentionVariant] = None,
                k_scale=None, v_scale=None, sinks: Optional[torch.Tensor] = None, rope=None):
        """k_scale / v_scale: a scaled cache's scales, per tensor (floats: FlashInfer folds k_scale into the softmax
        scale and multiplies the output by v_scale) or per KV head (float32 [Hk, 1]: q times its KV head's k_scale,
        the output times v_scale); sinks [H]: attention sinks (the output rescaled from the kernel's log-sum-exp).
        See attention/flashinfer_run.py. rope (ops/fused_rope_store.RopeStore): q / k not yet normed and rotated, k / v
        not yet stored; the Triton decode kernel does it in its launch, FlashInfer's kernels after `rope.apply`."""
        if self._wrapper is None:
            raise RuntimeError("FlashInferBackend.forward before plan(ctx)")
        if abs(scale - self.sm_scale) > 1e-9 * max(1.0, abs(scale)):
            raise ValueError(f"attention scale {scale} differs from the planned one {self.sm_scale}")
        variant = variant or FULL
        if (sinks is not None) != variant.sinks:
            raise ValueError(f"attention variant {variant}: pass `sinks` exactly when the variant has sinks")
        wrapper = self._plans.get(variant)
        if wrapper is None:
            # a variant seen for the first time: register it and plan it for this step (eager steps only)
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"attention variant {variant} was not planned before graph capture: "
                                   "register it with add_variants(...) first")
            self.add_variants((variant,))
            wrapper = self._plan_variant(variant)
        if rope is not None:
            if isinstance(wrapper, TritonDecodeWrapper):
                return run_attention(wrapper, q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                     rope=rope)
            q, k = rope.apply(q, k_cache, v_cache)
        if self._mode == "ragged":      # (never scaled: a float8 cache plans paged prefill)
            return run_attention(wrapper, q, (k.contiguous(), v.contiguous()), k_scale=k_scale, v_scale=v_scale,
                                 sinks=sinks, ragged=True)
        return run_attention(wrapper, q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, sinks=sinks)
