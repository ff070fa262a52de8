"""Decode CUDA graphs: one graph per batch-size bucket, captured once at start-up, replayed every decode step.

Buckets come from the engine's `cuda_graph_sizes` (default: 1, 2, 4, 8, then multiples of 16 up to
`max_num_seqs`), capped at `max_num_seqs` (the cap itself closes the list, so every decode batch the
scheduler can form fits). A batch of B sequences runs in the smallest bucket >= B; rows
B..bucket-1 are padding rows, empty sequences: token 0 at position 0, KV slot -1 (the KV write skips it), no
KV pages (the page-index pointer repeats, never decreasing), last-page length 1. No page is allocated for them.

Where things live:
- static inputs: one int64 device buffer holds a bucket's token ids, positions ([B], or [R, B] for a runner
  with `position_rows` R > 1, e.g. mRoPE), KV slots and, for a model with recurrent-state layers, the state slot
  of each row, laid out per bucket as [ids | positions | slots | state slots], so one host-to-device copy fills a
  step; the runner's `decode_positions(seqs)` gives the positions;
- recurrent-state layers (runtime/layers/recurrent/): the bucket's ForwardContext holds the static state-slot
  view as `state_slots`; a mixer's decode step reads only it (index_select of its rows of the state pool, the new
  states written back with index_copy_: no host value, no data-dependent shape). Padding rows hold the runner's
  scratch slot (`state_scratch_slot`, a pool row the block manager never hands out), so they never touch a live
  sequence's state;
- attention (a model with attention layers; one without has nothing to plan): the backend's per-bucket decode
  wrappers, one per attention variant of the model (sliding window / soft-cap;
  `backend.variant_graph_wrappers[variant][b]`, registered from `runner.attn_layers` before capture; a plain
  model has one variant, `backend.graph_wrappers[b]`), built with
  use_cuda_graph=True over persistent indptr / last-page-length buffers and one page-index buffer shared by
  all buckets, `backend.page_indices_buf`, sized for the worst case; made by `backend.ensure_graph_buckets`).
  The host builds the step's metadata in pinned memory (block tables converted to arrays once per change,
  reused as a whole while the batch and its page counts stay the same); the page indices go straight into
  the shared buffer (one copy), and the bucket's wrapper is planned once per step, outside the graph (see
  bucket_attention.py for the re-plan);
- outputs: each graph's hidden states [bucket, hidden] live in one memory pool shared by all graphs
  (torch.cuda.graph_pool_handle()); logits and sampling run outside the graph, on the first B rows.

Host work per step (the `run(seqs)` path): a few list comprehensions over the sequences, numpy writes into
two pinned buffers, two non-blocking host-to-device copies plus the planner's two small ones, the planner,
and the replay. Measured on an H200 host at batch 1: about 0.03 ms inputs, 0.04 ms copies, 0.1 ms plan.

`capture=False` (tests, CPU too): the same static inputs, padding and planning, but each step runs the bucket's
forward eagerly instead of replaying a graph, and attention runs the runner's own backend on the real rows (its
metadata re-derived from the bucket's indptr / last-page lengths / page indices, as the graph's wrappers read them);
the rest of the model (recurrent mixers, MoE, ...) runs on the padded batch exactly as captured.

Every bucket gets a warm-up run before capture (Triton compiles, cuBLAS picks its kernels, lazily moved
tables reach the device); buckets are captured largest first so smaller graphs reuse the pool's blocks.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from xllm_gen.runtime.attention.base import FULL, AttentionBackend, attention_variants
from xllm_gen.runtime.executor.bucket_attention import _BucketAttention, _EagerBucketAttention, _NoEvent
from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context


def graph_buckets(spec_buckets, max_num_seqs: int) -> tuple[int, ...]:
    """The requested buckets up to max_num_seqs; when larger ones were requested but none equal to
    max_num_seqs, max_num_seqs itself closes the list (so any batch the scheduler forms has a graph)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    spec = [int(b) for b in spec_buckets]
    buckets = sorted({b for b in spec if 0 < b <= max_num_seqs})
    if any(b > max_num_seqs for b in spec) and (not buckets or buckets[-1] < max_num_seqs):
        buckets.append(max_num_seqs)
    return tuple(buckets)


def capture_progress(items, desc: str, unit: str, enabled: bool = True):
    """`items`, in a tqdm progress bar when enabled and tqdm is installed (the bar closes when the loop ends)."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(items, desc=desc, unit=unit)
        except ImportError:                                # pragma: no cover
            pass
    return items


class DecodeGraphs:
    """`fits(B)`: a decode batch of B sequences has a graph. `run(seqs)`: the fast path, builds the step's
    inputs from the sequences in pinned memory, plans attention, replays. `replay(ids, pos, ctx)`: the same
    from what ModelRunner.prepare already built. Both return hidden states [B, hidden] (a view of the graph's
    static output, valid until the next replay)."""

    def __init__(self, runner, *, progress: bool = True, capture: bool = True):
        if capture and runner.device.type != "cuda":
            raise RuntimeError("decode CUDA graphs need a CUDA device")
        self.capture = capture
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.block_size
        self.buckets = graph_buckets(runner.graph_buckets, runner.max_num_seqs)
        if not self.buckets:
            raise ValueError("no decode graph bucket (graph_buckets is empty)")
        self.max_bs = self.buckets[-1]
        self._bucket_of = [0] * (self.max_bs + 1)
        it = iter(self.buckets)
        b = next(it)
        for n in range(1, self.max_bs + 1):
            while n > b:
                b = next(it)
            self._bucket_of[n] = b
        self.P = int(runner.position_rows)                  # rows of positions: [B] (1) or [P, B]
        # recurrent-state layers: a state-slot row in the static inputs; padding rows hold the scratch slot
        self.scratch_slot = getattr(runner, "state_scratch_slot", None) if getattr(runner, "state_layers", None) \
            else None
        self.has_state = self.scratch_slot is not None
        self.has_attention = bool(getattr(runner, "attn_layers", ()))
        self._S = 3 + self.P if self.has_state else 2 + self.P   # int64 rows of the static inputs per bucket row

        backend = runner.backend
        if self.has_attention and not capture:                 # the runner's backend on the real rows (tests)
            by_variant, variants = {}, ()
            worst = self.max_bs * ((runner.max_model_len + self.block_size - 1) // self.block_size)
            self.page_indices = torch.zeros(worst, dtype=torch.int32, device=self.device)
        elif self.has_attention:
            by_variant, variants = self._attention_wrappers(runner, backend)
            self.page_indices = backend.page_indices_buf       # shared by all buckets (worst-case size)
        else:                                                  # a purely recurrent model: nothing to plan
            by_variant, variants = {}, ()
            self.page_indices = None
        self.max_pages = self.page_indices.numel() if self.page_indices is not None else 0

        # Static inputs: for bucket Bk the layout is [ids (Bk) | positions (P*Bk) | slots (Bk) | state slots (Bk)].
        n64 = self._S * self.max_bs
        pin = self.device.type == "cuda"
        self._h64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self._h64_np = self._h64.numpy()
        self._d64 = torch.zeros(n64, dtype=torch.int64, device=self.device)
        # Attention metadata on the host: [indptr (max+1) | last_page_len (max) | indices (max_pages)].
        m = self.max_bs
        self._ind0 = 2 * m + 1
        self._h32 = torch.zeros(self._ind0 + self.max_pages, dtype=torch.int32, pin_memory=pin)
        self._h32_np = self._h32.numpy()
        self._indptr_h = [self._h32[: b + 1] for b in range(m + 1)]            # views per batch size
        self._last_h = [self._h32[m + 1: m + 1 + b] for b in range(m + 1)]
        self._table_cache: dict = {}                       # id(block table) -> (table, len, int32 array)
        self._prev_pages = None                            # (tables, page counts) whose indices the buffer holds
        # pinned buffers are rewritten only after their copy
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else _NoEvent()
        self._copied.record()

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._ctx: dict[int, ForwardContext] = {}
        self._attn: dict[int, Optional[AttentionBackend]] = {}
        for b in self.buckets:
            if not self.has_attention:
                self._attn[b] = None
            elif capture:
                self._attn[b] = _BucketAttention(backend, {v: by_variant[v][b] for v in variants}, b)
            else:
                self._attn[b] = _EagerBucketAttention(backend, b, self.block_size, self._views(b)[2])
        self.pool = None
        self.capture_seconds = 0.0
        self._capture_all(progress)

    def _attention_wrappers(self, runner, backend):
        """({variant: {bucket: decode wrapper}}, variants): the model's attention variants (sliding window / soft-cap
        per layer), one decode wrapper per variant per bucket, all made before capture."""
        variants = attention_variants(getattr(runner, "attn_layers", ()))
        add = getattr(backend, "add_variants", None)
        if add is not None and variants:
            add(variants)
        ensure = getattr(backend, "ensure_graph_buckets", None)
        if ensure is not None:
            ensure(self.buckets)                               # per-bucket decode wrappers (before capture)
        by_variant = getattr(backend, "variant_graph_wrappers", None)
        if by_variant is None:
            wrappers = getattr(backend, "graph_wrappers", None)
            by_variant = {FULL: wrappers} if wrappers is not None else {}
        variants = variants or (FULL,)
        missing = [(b, v) for v in variants for b in self.buckets if b not in by_variant.get(v, {})]
        if missing:
            raise RuntimeError(f"{type(backend).__name__} has no CUDA-graph decode wrapper for (bucket, variant) "
                               f"{missing}: build the backend with graph_buckets={self.buckets} and the model's "
                               "attention variants")
        return by_variant, variants

    # ---- buckets ------------------------------------------------------------------------------------
    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def bucket_for(self, batch_size: int) -> int:
        return self._bucket_of[batch_size]

    def _views(self, Bk: int):
        d = self._d64
        ids = d[:Bk]
        pos = d[Bk: (1 + self.P) * Bk]
        if self.P > 1:
            pos = pos.view(self.P, Bk)
        slots = d[(1 + self.P) * Bk: (2 + self.P) * Bk]
        return ids, pos, slots

    def state_slot_view(self, Bk: int) -> Optional[torch.Tensor]:
        """The bucket's static state-slot input [Bk] (None: the model has no recurrent-state layers)."""
        if not self.has_state:
            return None
        return self._d64[(2 + self.P) * Bk: (3 + self.P) * Bk]

    # ---- capture ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self, progress: bool) -> None:
        runner = self.runner
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        order = sorted(self.buckets, reverse=True)
        for Bk in capture_progress(order, "Capturing decode CUDA graphs", "graph", progress):
            ids, pos, slots = self._views(Bk)
            ctx = ForwardContext(
                is_prefill=False,
                cu_seqlens_q=torch.arange(Bk + 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.ones(Bk, dtype=torch.int32, device=self.device),
                slot_mapping=slots,
                block_tables=torch.zeros(Bk, 0, dtype=torch.int32, device=self.device),
                block_size=self.block_size, seq_lens_cpu=None, query_lens_cpu=[1] * Bk,
                backend=self._attn[Bk], extra={"graph_bucket": Bk},
                state_slots=self.state_slot_view(Bk))     # every row continues its state (decode)
            self._ctx[Bk] = ctx
            if not self.capture:
                continue
            # every row a padding row: the warm-up run touches the scratch state slot only
            total = self._write_step(0, Bk, [], [], [], [], [])
            self._upload(Bk, total)
            self._plan(Bk, total)                          # planned outside the graph
            set_context(ctx)
            try:
                runner.forward(ids, pos, ctx, None)        # warm-up: compiles, lazily moved tables, cuBLAS
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = runner.forward(ids, pos, ctx, None)
            finally:
                reset_context()
            self.graphs[Bk] = g
            self.outputs[Bk] = out
        if self.capture:
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def _replay(self, Bk: int) -> torch.Tensor:
        """The bucket's graph replayed (capture=False: its forward run eagerly on the static inputs)."""
        if self.capture:
            self.graphs[Bk].replay()
            return self.outputs[Bk]
        ids, pos, _ = self._views(Bk)
        set_context(self._ctx[Bk])
        try:
            self.outputs[Bk] = self.runner.forward(ids, pos, self._ctx[Bk], None)
        finally:
            reset_context()
        return self.outputs[Bk]

    # ---- one step -----------------------------------------------------------------------------------
    def _write_step(self, B: int, Bk: int, ids, pos, slots, lens, tables, state_slots=()) -> int:
        """Writes one step's inputs and attention metadata (padded to Bk rows) into the pinned buffers;
        returns the number of KV pages of the step. `lens`: KV length of each sequence after the step;
        `state_slots`: each sequence's recurrent-state slot (a model with recurrent-state layers)."""
        if not self._copied.query():                       # the previous step's copy still reads them
            self._copied.synchronize()
        bs = self.block_size
        P = self.P
        h = self._h64_np
        h[:B] = ids
        h[B:Bk] = 0
        if P == 1:
            h[Bk: Bk + B] = pos
            h[Bk + B: 2 * Bk] = 0
        else:
            block = h[Bk: (1 + P) * Bk].reshape(P, Bk)
            block[:, :B] = np.asarray(pos, dtype=np.int64).reshape(P, B)
            block[:, B:] = 0
        s0 = (1 + P) * Bk
        h[s0: s0 + B] = slots
        h[s0 + B: s0 + Bk] = -1
        if self.has_state:
            r0 = s0 + Bk
            if B:
                if len(state_slots) != B or any(sl is None for sl in state_slots):
                    raise RuntimeError("a decode graph step of a model with recurrent-state layers needs each "
                                       f"sequence's state slot, got {list(state_slots)} for {B} sequences")
                h[r0: r0 + B] = state_slots
            h[r0 + B: r0 + Bk] = self.scratch_slot            # padding rows: the scratch slot
        if not self.has_attention:                             # no KV pages to describe
            return 0
        m = self.max_bs
        h32 = self._h32_np
        h32[0] = 0
        total = 0
        if B:
            L = np.asarray(lens, dtype=np.int64)
            npages = (L + bs - 1) // bs
            ptr = np.cumsum(npages)
            total = int(ptr[-1])
            if total > self.max_pages:
                raise RuntimeError(f"decode step needs {total} KV pages; the graph page buffer holds {self.max_pages}")
            h32[1: B + 1] = ptr
            h32[m + 1: m + 1 + B] = L - (npages - 1) * bs
            if total:
                self._write_pages(tables, npages, total)
        else:
            self._prev_pages = None
        h32[B + 1: Bk + 1] = total                         # padding rows: pointer repeated (no pages)
        h32[m + 1 + B: m + 1 + Bk] = 1                     # padding rows: last-page length 1
        return total

    def _write_pages(self, tables: list, npages: np.ndarray, total: int) -> None:
        """The step's page indices, concatenated into the pinned buffer. Usually a decode batch is the last
        one again with no sequence grown by a page: then the buffer already holds them. Otherwise each table
        is converted once per change. Both rely on BlockManager only appending to a table or replacing it by
        a new list (free): the same list object with the same page count has the same first pages. The
        references kept here keep the objects alive, so their identities are not reused."""
        prev = self._prev_pages
        counts = npages.tolist()
        if (prev is not None and prev[1] == counts and all(a is b for a, b in zip(prev[0], tables))):
            return
        cache, nxt = self._table_cache, {}
        parts = []
        for t, k in zip(tables, counts):
            hit = cache.get(id(t))
            if hit is None or hit[0] is not t or hit[1] != len(t):
                hit = (t, len(t), np.asarray(t, dtype=np.int32))
            nxt[id(t)] = hit
            parts.append(hit[2][:k])
        self._table_cache = nxt
        np.concatenate(parts, out=self._h32_np[self._ind0: self._ind0 + total])
        self._prev_pages = (list(tables), counts)

    def _upload(self, Bk: int, total_pages: int) -> None:
        n64 = self._S * Bk
        self._d64[:n64].copy_(self._h64[:n64], non_blocking=True)
        if total_pages:
            self.page_indices[:total_pages].copy_(self._h32[self._ind0: self._ind0 + total_pages],
                                                  non_blocking=True)
        self._copied.record()

    def _plan(self, Bk: int, total_pages: int) -> None:
        """Plans the bucket's wrapper once for the step, outside the graph. indptr / last_page_len go as pinned
        host views (the planner needs them on the host, and copies them into the bucket's persistent buffers);
        the page indices are already in the shared device buffer (so the planner's copy is a no-op)."""
        if self._attn[Bk] is None:                             # no attention layers: nothing to plan
            return
        self._attn[Bk].plan_decode(self._indptr_h[Bk], self._last_h[Bk], self.page_indices[:total_pages])
        self._copied.record()

    def run(self, seqs, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decode step of `seqs` (each one's last token not yet in the KV cache); hidden [B, hidden].
        `input_ids`: the step's input tokens already on the device [B] (async decode: the previous step's
        argmax), written over the host ids after the upload; None: each sequence's last token."""
        B = len(seqs)
        Bk = self._bucket_of[B]
        bs = self.block_size
        lens = [s.num_tokens_with_pending for s in seqs]
        tables = [s.block_table for s in seqs]
        ids = [0] * B if input_ids is not None else [s.token_ids[-1] for s in seqs]
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        pos = self.runner.decode_positions(seqs)           # [P * B], row-major
        states = [s.state_slot for s in seqs] if self.has_state else ()
        total = self._write_step(B, Bk, ids, pos, slots, lens, tables, states)
        self._upload(Bk, total)
        if input_ids is not None:
            self._views(Bk)[0][:B].copy_(input_ids)
        self._plan(Bk, total)
        return self._replay(Bk)[:B]

    def replay(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The ModelRunner hook, with the inputs prepare() built (device tensors): lengths from
        ctx.seq_lens_cpu; block tables from ctx.extra["block_tables_cpu"] when given, else read back from the
        device (one small copy)."""
        B = ids.shape[0]
        Bk = self._bucket_of[B]
        lens = list(ctx.seq_lens_cpu) if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        tables = (ctx.extra or {}).get("block_tables_cpu")
        if tables is None:
            tables = ctx.block_tables.cpu().tolist()
        bs = self.block_size
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        states = ()
        if self.has_state:
            states = ctx.state_slots_cpu if ctx.state_slots_cpu is not None else ctx.state_slots.tolist()
        total = self._write_step(B, Bk, [0] * B, [0] * (B * self.P), slots, lens, tables, states)
        self._upload(Bk, total)
        s_ids, s_pos, _ = self._views(Bk)                  # prepare()'s device inputs over the placeholders
        s_ids[:B].copy_(ids)
        if self.P > 1:
            s_pos[:, :B].copy_(pos)
        else:
            s_pos[:B].copy_(pos)
        self._plan(Bk, total)
        return self._replay(Bk)[:B]
