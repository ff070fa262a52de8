"""Piecewise prefill CUDA graphs: an eager prefill is host-bound (about 15 ms of Python and launches for
a 0.6B-parameter model, whatever the prompt length, against a few ms of GPU work at 1024 tokens), so prefill steps replay
graphs too. Attention cannot be captured whole (its plan depends on every sequence's length), so the model is
captured in pieces, split at every attention layer:

    piece 0 | attention 0 | piece 1 | attention 1 | ... | piece L

One set of pieces per token-count bucket (`prefill_graph_sizes`, default 16 ... 4096 capped at the engine's
`max_num_batched_tokens`). A prefill step of N tokens runs in the smallest bucket T >= N: its token ids and
positions are copied into the bucket's static inputs (rows N..T-1 are padding rows, left as they were), then each
piece is replayed and each attention layer runs eagerly between them, on the first N rows only, with the step's
forward context (KV write, FlashInfer prefill over the real sequences, already planned by the runner).

How a piece boundary is made: while capturing, the forward context's `graph_break` is set; the Attention layer
hands its q / k / v to it instead of attending. The break copies them (inside the piece being captured) into
static buffers shared by all layers of the same shape, ends that piece's graph, and begins the next one; the
layer's output is a static buffer too, which the next piece reads. Everything between two attention layers
(norms, projections, MLP or MoE, residuals, TP all-reduces) is thus replayed, and only attention is eager.
Rows never mix outside attention (every other op is row-wise), so padding rows cannot change real rows.

All pieces of all buckets share one memory pool; buckets are captured largest first and replayed one at a
time, so the pool's blocks are reused safely (torch.cuda.graph's rule: replay in capture order).

Runners with multimodal steps (their `prefill_embeds` returns inputs_embeds with vision features at the
visual rows) are captured on a static inputs_embeds buffer instead of token ids: a text-only step fills it with
`model.embed_input_ids(ids)`. Step inputs that layers read from the forward context (deepstack features) are
put there, as static buffers of the bucket's size, by the runner's `prefill_graph_context(ctx, T)` hook; a
step writes its rows into them before the replay (rows it does not use hold zeros). A runner that overrides
`forward` prefills eagerly, and so does a step larger than the largest bucket.
"""
from __future__ import annotations

import bisect
import time
from typing import Optional

import torch

from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context
from xllm_gen.runtime.executor.cuda_graph import capture_progress

# token-count buckets; prompts above the largest one are compute-bound enough to prefill eagerly
DEFAULT_PREFILL_GRAPH_SIZES = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


def prefill_graph_sizes(requested, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The requested buckets (default DEFAULT_PREFILL_GRAPH_SIZES) up to max_num_batched_tokens."""
    sizes = DEFAULT_PREFILL_GRAPH_SIZES if requested is None else tuple(requested)
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"prefill_graph_sizes must be positive integers, got {requested!r}")
    return tuple(sorted({b for b in sizes if b <= max_num_batched_tokens}))


def uses_inputs_embeds(runner) -> bool:
    """Whether the runner's prefill steps may carry inputs_embeds (it overrides ModelRunner.prefill_embeds)."""
    from xllm_gen.runtime.executor.model_runner import ModelRunner
    return type(runner).prefill_embeds is not ModelRunner.prefill_embeds


def supports_prefill_graphs(runner) -> bool:
    """A runner whose step is `model(ids, positions, inputs_embeds)` (it does not override forward), and whose
    model can embed token ids itself when its steps may carry inputs_embeds."""
    from xllm_gen.runtime.executor.model_runner import ModelRunner
    if type(runner).forward is not ModelRunner.forward:
        return False
    return not uses_inputs_embeds(runner) or callable(getattr(runner.model, "embed_input_ids", None))


class _Pieces:
    """The captured pieces of one bucket and, between them, the attention layers that run eagerly."""

    def __init__(self):
        self.graphs: list[torch.cuda.CUDAGraph] = []
        # (attention layer, its buffers' key, its attention sinks: the owning module's parameter, or None)
        self.holes: list[tuple[torch.nn.Module, tuple, Optional[torch.Tensor]]] = []
        self.output: Optional[torch.Tensor] = None


class PrefillGraphs:
    """`fits(N)`: a prefill step of N tokens has a bucket. `run(ids, pos, ctx)`: replays the bucket's pieces with
    eager attention between them; returns hidden states [N, hidden] (a view of the bucket's static output,
    valid until the next replay). The runner plans attention for `ctx` and sets it as the forward context."""

    def __init__(self, runner, sizes, *, progress: bool = True):
        if runner.device.type != "cuda":
            raise RuntimeError("prefill CUDA graphs need a CUDA device")
        self.runner = runner
        self.device = runner.device
        self.sizes = tuple(sorted(set(sizes)))
        if not self.sizes:
            raise ValueError("no prefill graph bucket")
        self.max_tokens = self.sizes[-1]
        self.P = int(runner.position_rows)
        T = self.max_tokens
        self._ids = torch.zeros(T, dtype=torch.int64, device=self.device)
        self._pos = torch.zeros((self.P, T) if self.P > 1 else (T,), dtype=torch.int64, device=self.device)
        # multimodal runners: the pieces read inputs_embeds [T, hidden] (vision features merged by prefill_embeds)
        self.embeds_input = uses_inputs_embeds(runner)
        self._embeds = (torch.zeros(T, runner.config.hidden_size, dtype=runner.dtype, device=self.device)
                        if self.embeds_input else None)
        # attention inputs / output, shared by every layer (and bucket) of one shape: (H, Hk, D, dtype) -> q, k, v, o
        self._buffers: dict[tuple, tuple[torch.Tensor, ...]] = {}
        for layer in runner.attn_layers:
            self._buffers_for(layer)
        self.pieces: dict[int, _Pieces] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self._capture_all(progress)

    # ---- buckets ------------------------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def bucket_for(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def _buffers_for(self, layer) -> tuple:
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, layer.k_cache.dtype)
        if key not in self._buffers:       # value heads may have a width of their own (Dv)
            H, Hk, D, Dv, T = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, self.max_tokens
            dt = self.runner.dtype
            z = lambda *s: torch.zeros(*s, dtype=dt, device=self.device)      # noqa: E731
            self._buffers[key] = (z(T, H, D), z(T, Hk, D), z(T, Hk, Dv), z(T, H * Dv))
        return key

    # ---- capture ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self, progress: bool) -> None:
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        order = sorted(self.sizes, reverse=True)          # largest first: smaller buckets reuse the pool's blocks
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))     # the zeroed buffers
        for T in capture_progress(order, "Capturing prefill CUDA graphs", "bucket", progress):
            self.pieces[T] = self._capture(T, stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def _capture(self, T: int, stream: torch.cuda.Stream) -> _Pieces:
        runner = self.runner
        ids = self._ids[:T]
        pos = self._pos[..., :T]
        embeds = self._embeds[:T] if self.embeds_input else None
        pieces = _Pieces()
        capturing = False

        def graph_break(layer, q, k, v, sinks=None):
            key = self._buffers_for(layer)
            qb, kb, vb, ob = self._buffers[key]
            qb[:T].copy_(q)                                 # inside the piece being captured
            kb[:T].copy_(k)
            vb[:T].copy_(v)
            if capturing:
                pieces.graphs[-1].capture_end()
                pieces.holes.append((layer, key, sinks))
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self.pool)
                pieces.graphs.append(g)
            return ob[:T]

        ctx = ForwardContext(is_prefill=True, cu_seqlens_q=None, seq_lens=None, slot_mapping=None,
                             block_tables=None, graph_break=graph_break)
        runner.prefill_graph_context(ctx, T)               # static step inputs read by layers (deepstack)
        set_context(ctx)
        try:
            with torch.cuda.stream(stream):
                runner.forward(ids, pos, ctx, embeds)       # warm-up: Triton compiles, cuBLAS picks its kernels
                stream.synchronize()
                capturing = True
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self.pool)
                pieces.graphs.append(g)
                try:
                    pieces.output = runner.forward(ids, pos, ctx, embeds)
                finally:
                    pieces.graphs[-1].capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        finally:
            reset_context()
        if len(pieces.holes) != len(runner.attn_layers):
            raise RuntimeError(f"prefill graph capture met {len(pieces.holes)} attention calls for "
                               f"{len(runner.attn_layers)} attention layers")
        return pieces

    # ---- one step -----------------------------------------------------------------------------------
    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext,
            embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`embeds`: the step's inputs_embeds from the runner's prefill_embeds (None: embed the ids)."""
        N = ids.shape[0]
        pieces = self.pieces[self.bucket_for(N)]
        self._pos[..., :N].copy_(pos, non_blocking=True)
        if self.embeds_input:
            self._embeds[:N].copy_(embeds if embeds is not None else self.runner.model.embed_input_ids(ids))
        else:
            self._ids[:N].copy_(ids, non_blocking=True)
        graphs, holes = pieces.graphs, pieces.holes
        for i, (layer, key, sinks) in enumerate(holes):
            graphs[i].replay()
            qb, kb, vb, ob = self._buffers[key]
            # eager attention on the real rows (ctx is set), on the heads as the break received them (padded ones too)
            ob[:N].copy_(layer.attend(qb[:N], kb[:N], vb[:N], sinks))
        graphs[-1].replay()
        return pieces.output[:N]
