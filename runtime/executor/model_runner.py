"""The generic runner machinery: KV-cache allocation, input preparation, attention planning, decode and
prefill graphs, logits. A generated runner module (generated/<name>/runner.py) subclasses ModelRunner with the model module
it runs and the step logic its spec implies, through the hooks below; this file knows no model.

Hooks (neutral defaults: a text model with 1-D positions needs none of them):
- `position_rows`: rows of the positions tensor (1: positions [N]; R > 1: positions [R, N]);
- `positions_of(seq, start, end)`: the positions of a sequence's tokens start..end-1 (default: arange);
- `decode_positions(seqs)`: the flattened [position_rows * B] positions of a decode step, as decode graphs
  write them into their static inputs (default: each sequence's last index);
- `allocate_step_buffers()`: fixed-size buffers a step needs, made once before any graph capture;
- `prefill_embeds(seqs, ids, ctx)`: inputs_embeds of a prefill step (e.g. merged vision features), or None to
  let the model embed the token ids;
- `after_step(ctx)`: called after every prefill or eager step, also after a failure (e.g. clears step buffers);
- `prefill_graph_context(ctx, T)`: puts the static step inputs layers read from the forward context (e.g.
  deepstack buffers of T rows) into ctx before a prefill graph of T tokens is captured.

Deployment (graph sizes, batch limits, chunked prefill, TP size) comes from the engine's options.

One step: build the flattened inputs and the ForwardContext of the scheduled sequences, plan attention
once, run the model, and return float32 logits of each sequence's last row (sampling is the engine's).

Beside this file: the state pool and KV-cache sizing / allocation (runner_cache.py) and the attention backend
choice (runner_backend.py) are ModelRunner's bases; build_errors.py words a config the model cannot be built from.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from xllm_gen.runtime import layers as L
from xllm_gen.runtime import ops
from xllm_gen.runtime.engine.sampler import greedy_argmax
from xllm_gen.runtime.engine.sequence import Sequence
from xllm_gen.runtime.executor.build_errors import _model_build_error
from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.prefill_graphs import PrefillGraphs, supports_prefill_graphs
from xllm_gen.runtime.executor.prefill_graphs import prefill_graph_sizes as prefill_graph_sizes_of
from xllm_gen.runtime.executor.runner_backend import RunnerAttentionBackend
from xllm_gen.runtime.executor.runner_cache import RunnerCacheSetup
from xllm_gen.runtime.layers.linear import tune_decode_gemms
from xllm_gen.runtime.layers.quant_tuning import tune_quant_gemvs
from xllm_gen.runtime.loading.checkpoint_files import CheckpointFileError
from xllm_gen.runtime.loading.loader import load_weights
from xllm_gen.runtime.loading.quant_config import kv_cache_torch_dtype, parse_quant_config

logger = logging.getLogger("xllm_gen")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode-graph batch sizes when the engine is given none: 1, 2, 4, 8, then multiples of 16 up to
    max_num_seqs (which closes the list)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


class ModelRunner(RunnerCacheSetup, RunnerAttentionBackend):
    # Set by the generated runner module (what the spec's model needs; deployment comes from the engine).
    model_module = None
    position_rows = 1               # 1: positions [N]; R > 1: positions [R, N]
    multimodal = False              # requests carry images / videos through the checkpoint's processor
    supports_async_decode = True    # decode_greedy: the engine may launch a decode step from device tokens

    def __init__(self, model_dir: str, hf_config: dict, *, device: torch.device, dtype: torch.dtype,
                 block_size: int, num_kv_blocks: Optional[int], max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, gpu_memory_utilization: float = 0.85,
                 enforce_eager: bool = False, load_format: str = "auto", cuda_graph_sizes=None,
                 prefill_graph_sizes=None, debug: Optional[dict] = None, quantization: Optional[str] = None,
                 kv_cache_dtype: str = "auto"):
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.debug = dict(debug or {})
        sizes = default_graph_sizes(max_num_seqs) if cuda_graph_sizes is None else tuple(cuda_graph_sizes)
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {cuda_graph_sizes!r}")
        self.graph_buckets = tuple(sorted(set(sizes)))
        if self.device.type == "cuda" and dtype == torch.float32 and not self.debug.get("torch_attention"):
            # FlashInfer has no float32 kernels: a float32 run on CUDA (a reference run) takes the torch paged
            # attention, eagerly (the decode graphs are built around FlashInfer's wrappers)
            logger.warning("dtype float32 on CUDA: attention runs in torch, without CUDA graphs (FlashInfer has no "
                           "float32 kernels); use bfloat16 or float16 to serve")
            self.debug["torch_attention"] = True
            enforce_eager = True
        if self.device.type == "cuda" and ops._FORCE_TORCH and not enforce_eager:
            # the torch references store the KV cache by boolean indexing (a host sync): not capturable
            logger.warning("XLLM_OPS=torch (debugging: the torch reference of every fused op) runs eagerly, "
                           "without CUDA graphs")
            enforce_eager = True
        self.enforce_eager = enforce_eager or self.device.type != "cuda"
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        self.config = self.model_module.Config.from_hf(hf_config)
        quant = parse_quant_config(hf_config, quantization) if load_format != "dummy" else None
        from xllm_gen.runtime.layers.moe import experts_on_meta
        from xllm_gen.runtime.loading.quant_load import packs_experts
        # float8 experts the load keeps packed are never allocated at the compute dtype's size
        on_meta = experts_on_meta() if packs_experts(quant, self.device, dtype) else contextlib.nullcontext()
        try:
            with torch.device(self.device), _default_dtype(dtype), on_meta:
                self.model = self.model_module.Model(self.config)
        except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError) as e:
            raise CheckpointFileError(f"{Path(model_dir) / 'config.json'}: "
                                      f"{_model_build_error(self.model_module, e)}") from None
        self.model.eval()
        long_regime = set()
        for m in self.model.modules():     # rope scalings that depend on the context (longrope) choose from it
            if isinstance(m, L.Rotary):
                m.set_context_len(max_model_len)
                long_regime.add(m.long_regime_original())
        long_regime.discard(None)
        if long_regime and get_tp_rank() == 0:   # every position takes long_factor: say so (short ones differ from HF)
            logger.warning("longrope: max_model_len %d exceeds the original context %s, so every position uses "
                           "the long-context regime (long_factor / long_mscale, as vLLM); transformers uses the short "
                           "one while a sequence is within the original context, so outputs of such sequences differ "
                           "from it. Set max_model_len <= %s to serve them in the short regime.", max_model_len,
                           min(long_regime), min(long_regime))
        if load_format == "dummy":         # random weights, for benchmarks of a shape without a checkpoint
            self.loaded_params = self._init_dummy_weights()
            if self.debug.get("dummy_quantize"):   # and quantized in place (bench/bench_quant.py --e2e)
                from xllm_gen.runtime.layers.quant_linear import quantize_dummy
                quantize_dummy(self.model, self.debug["dummy_quantize"], skip=self.debug.get("dummy_quantize_skip", ()))
        else:
            self.loaded_params = load_weights(
                self.model, self.model_module.weight_plan(self.model), model_dir,
                tp_size=get_tp_size(), tp_rank=get_tp_rank(),
                ignored=getattr(self.model_module, "IGNORED_CHECKPOINT_TENSORS", ()),
                quant=quant, kv_cache_dtype=kv_cache_dtype,
                renames=getattr(self.model_module, "CHECKPOINT_RENAMES", ()))
        for m in self.model.modules():     # weight transforms a module does once its weights are loaded (a normalized
            finish = getattr(m, "finish_loading", None)    # LM head): after the dummy weights too
            if callable(finish):
                finish()
        # the attention layers with a KV cache of their own (a layer that reads another's, L.share_kv, has none)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, L.Attention) and m.kv_owner is None]
        self.kv_reader_layers = [m for m in self.model.modules() if isinstance(m, L.Attention) and m.kv_owner is not None]
        # sparse-attention indexers: a paged key cache each, on the KV cache's blocks (runtime/layers/indexer.py)
        # and per-key score biases (runtime/layers/key_bias.py): a paged cache each as well
        self.index_layers = [m for m in self.model.modules() if isinstance(m, (L.SparseIndexer, L.ValueKeyBias))]
        if self.debug.get("kv_scales"):    # benchmarks with dummy weights: every layer's KV-cache scales (k, v)
            if self.kv_dtype != torch.float8_e4m3fn:
                raise ValueError("debug kv_scales needs kv_cache_dtype='fp8'")
            for layer in self.attn_layers:
                layer.k_scale, layer.v_scale = (float(x) for x in self.debug["kv_scales"])
        self._pad_head_dims()              # head dims the CUDA kernels lack: zero-padded heads (a wider cache)
        self._allocate_state_pool()
        self.num_kv_blocks = num_kv_blocks or self._auto_num_blocks(gpu_memory_utilization)
        self._allocate_kv_cache()
        self.backend = self._make_backend()
        self._apply_debug()
        self.allocate_step_buffers()       # fixed size and address, before any graph capture
        self._planned = None               # CUDA event after the last eager step's attention plan
        self.graphs = None                 # decode CUDA graphs, one per bucket (runtime/cuda_graph.py)
        if self.device.type == "cuda":     # decode GEMMs: cuBLAS or the Triton skinny GEMM, measured per shape
            rows = self.graph_buckets if not self.enforce_eager else (1, 2, 4, 8)
            # packed int4 / fp8 layers first: the fused-prologue tuning (in tune_decode_gemms) of packed fp8 layers
            # times their plain pair with the decode GEMM chosen here
            self.quant_gemv_tuning = tune_quant_gemvs(self.model, rows)
            if self.quant_gemv_tuning:
                logger.info("packed-weight decode GEMMs measured (tensor-core us, split-K us, choice): %s",
                            self.quant_gemv_tuning)
            t0 = time.perf_counter()
            self.decode_gemm_tuning = tune_decode_gemms(self.model, rows)
            if self.decode_gemm_tuning:      # what was measured now (the rest came from ops/tuning_cache.py)
                logger.info("decode GEMMs tuned: %d (rows, N, K) measured in %.1f s", len(self.decode_gemm_tuning),
                            time.perf_counter() - t0)
            picked = sorted(k for k, v in self.decode_gemm_tuning.items() if v[2])
            if picked:
                logger.info("decode GEMMs on the Triton skinny GEMM (rows, N, K): %s", picked)
        if not self.enforce_eager and self.graph_buckets:
            from xllm_gen.runtime.executor.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self)
            if self.state_layers:
                logger.info("decode CUDA graphs captured for buckets %s with %d recurrent-state layers (%s): each "
                            "bucket reads its sequences' state slots from a static slot buffer (padding rows: the "
                            "scratch slot %d); prefill runs eagerly", self.graphs.buckets, len(self.state_layers),
                            type(self.state_layers[0]).__name__, self.state_scratch_slot)
        elif self.debug.get("uncaptured_decode_graphs") and self.graph_buckets:
            # test-only (any device): the decode graphs' static inputs, padding and planning, each bucket's forward
            # run eagerly instead of captured (runtime/executor/cuda_graph.py, capture=False)
            from xllm_gen.runtime.executor.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self, progress=False, capture=False)
        # piecewise prefill graphs (runtime/executor/prefill_graphs.py), for runners whose step is model(ids, pos);
        # not for a model with recurrent-state layers: a prefill mixer runs per sequence from host slot values, which
        # a captured piece would freeze
        self.prefill_graphs = None
        psizes = prefill_graph_sizes_of(prefill_graph_sizes, max_num_batched_tokens)
        if (not self.enforce_eager and psizes and self.attn_layers and not self.state_layers
                and supports_prefill_graphs(self)):
            try:
                self.prefill_graphs = PrefillGraphs(self, psizes)
            except Exception as e:        # a model that cannot be captured still serves, with eager prefill
                logger.warning("prefill CUDA graphs could not be captured, prefill runs eagerly: %s: %s",
                               type(e).__name__, e)
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        # vision tower CUDA graphs per bucket of patch counts (runtime/executor/vision_graphs.py), captured lazily;
        # opt-in (XLLM_VISION_GRAPHS=1) until they have run on a GPU
        self.vision_graphs = None
        tower = getattr(self.model, "vision_tower", None)
        if (tower is not None and not self.enforce_eager and get_tp_size() == 1
                and dtype in (torch.float16, torch.bfloat16) and not self.debug.get("vision_eager")
                and (self.debug.get("vision_graphs") or os.environ.get("XLLM_VISION_GRAPHS") == "1")):
            from xllm_gen.runtime.executor.vision_graphs import VisionGraphs
            self.vision_graphs = VisionGraphs(tower())

    def shutdown(self) -> None:
        """Releases the model, the KV cache, the decode graphs, the attention workspaces and every step
        buffer now, so that the next engine of this process gets the memory (idempotent; the runner cannot
        run afterwards)."""
        if getattr(self, "model", None) is None:
            return
        for name, value in list(vars(self).items()):
            if isinstance(value, (torch.Tensor, torch.nn.Module)) or name in ("graphs", "prefill_graphs", "backend",
                                                                              "attn_layers", "vision_graphs",
                                                                              "state_layers", "index_layers"):
                setattr(self, name, None)
        if self.device.type == "cuda":
            # graphs and modules may hold each other: collected now, so that the next engine of the process finds
            # the GPU memory free (on the CPU the cycle collector frees them in its own time: a full collection per
            # engine cost 0.2-0.5 s, 16 s at the end of the test session)
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- set-up -------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_dummy_weights(self) -> set[str]:
        gen = torch.Generator(device=self.device).manual_seed(1234)
        for name, p in self.model.named_parameters():
            if p.dim() == 1:    # norm weights near 1 keep activations in range
                p.copy_(1.0 + 0.02 * torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32))
        return {n for n, _ in self.model.named_parameters()}

    def _apply_debug(self) -> None:
        """Test-only switches for sensitivity arms: `mrope_layout` ("blocked" / "interleaved") re-lays the
        frequency sections of every multi-axis rotary (a wrong layout must change vision outputs)."""
        layout = self.debug.get("mrope_layout")
        if layout:
            for m in self.model.modules():
                if isinstance(m, L.Rotary) and m.kind.startswith("mrope"):
                    m.kind = f"mrope_{layout}"
                    m.axis_map = L.mrope_axis_map(m.kind, m.mrope_section, m.head_dim // 2).to(self.device)

    # ---- hooks (the generated runner overrides what its spec needs) ----------------------------------
    def allocate_step_buffers(self) -> None:
        """Fixed-size buffers of the model's steps; none by default."""

    def positions_of(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Positions of the sequence's tokens start..end-1: [end - start] (position_rows 1)."""
        return torch.arange(start, end, dtype=torch.int64)

    def decode_positions(self, seqs: list[Sequence]) -> list[int]:
        """Positions of a decode step's tokens (each sequence's last), flattened row-major: [position_rows * B]."""
        return [s.num_tokens_with_pending - 1 for s in seqs]

    def prefill_embeds(self, seqs: list[Sequence], ids: torch.Tensor, ctx: ForwardContext) -> Optional[torch.Tensor]:
        """inputs_embeds [N, hidden] of a prefill step, or None: the model embeds the token ids itself."""
        return None

    def after_step(self, ctx: ForwardContext) -> None:
        """Called after every eager step (also after a failure); nothing by default."""

    def encode_vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor):
        """The model's vision tower on a request's pixel rows (grid_thw on the host): the CUDA graph of its
        patch-count bucket where one fits (vision_graphs), else eager (model.encode_vision)."""
        pixels = pixels.to(self.device, self.dtype)
        if self.vision_graphs is not None:
            return self.vision_graphs(pixels, grid_thw.cpu())
        return self.model.encode_vision(pixels, grid_thw.to(self.device))

    def prefill_graph_context(self, ctx: ForwardContext, num_tokens: int) -> None:
        """Puts the static step inputs that layers read from the forward context (fixed-size buffers of
        num_tokens rows) into `ctx` before a prefill graph is captured; nothing by default."""

    # ---- inputs ---------------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], is_prefill: bool):
        """The flattened step inputs. A decode input still on the device (num_pending) is a 0 here: the caller
        writes the device tokens over it. Built with numpy and moved in two copies (int64 rows, int32 metadata):
        a prefill step of 8k tokens built as Python lists and torch.tensor() calls cost milliseconds of host time
        per step while the GPU waited."""
        bs = self.block_size
        input_ids, positions, slots, cu_q, seq_lens, qlens = [], [], [], [0], [], []
        for seq in seqs:
            start = seq.num_computed_tokens if is_prefill else seq.num_tokens_with_pending - 1
            end = start + seq.chunk_len if is_prefill else start + 1
            input_ids.append(np.asarray(seq.token_ids[start:end] if is_prefill or not seq.num_pending else (0,),
                                        dtype=np.int64))
            positions.append(self.positions_of(seq, start, end))
            p = np.arange(start, end, dtype=np.int64)
            slots.append(np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs)
            cu_q.append(cu_q[-1] + end - start)
            seq_lens.append(end)
            qlens.append(end - start)
        n, B = cu_q[-1], len(seqs)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.full((B, max_blocks), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        dev = self.device
        # int64 rows: ids | slots | last rows; int32: cu_seqlens_q | seq_lens | block tables (row-major)
        rows = torch.from_numpy(np.concatenate(input_ids + slots + [np.asarray(cu_q[1:], dtype=np.int64) - 1])).to(dev)
        meta = torch.from_numpy(np.concatenate([np.asarray(cu_q, dtype=np.int32), np.asarray(seq_lens, dtype=np.int32),
                                                tables.reshape(-1)])).to(dev)
        ctx = ForwardContext(
            is_prefill=is_prefill,
            cu_seqlens_q=meta[:B + 1],
            seq_lens=meta[B + 1:2 * B + 1],
            slot_mapping=rows[n:2 * n],
            block_tables=meta[2 * B + 1:].view(B, max_blocks),
            block_size=bs, seq_lens_cpu=seq_lens, query_lens_cpu=qlens, backend=self.backend)
        if getattr(self, "num_state_slots", 0):      # recurrent mixers: each sequence's state slot
            ctx.state_slots_cpu = [s.state_slot for s in seqs]
            if any(sl is None for sl in ctx.state_slots_cpu):
                raise RuntimeError("a sequence of a model with recurrent layers has no state slot (the block manager "
                                   "assigns one at admission)")
            ctx.state_continue_cpu = [not is_prefill or s.num_computed_tokens > 0 for s in seqs]
            ctx.state_slots = torch.tensor(ctx.state_slots_cpu, dtype=torch.int64).to(dev)
        ids = rows[:n]
        pos = torch.cat(positions, dim=-1).to(dev)
        last_rows = rows[2 * n:]
        return ids, pos, ctx, last_rows

    # ---- execution ------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, all_rows: bool = False,
            input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits [B, vocab] of each sequence's last row (all rows of the step when all_rows).
        `input_ids` (decode): the step's input tokens on the device [B], for sequences whose last token is
        still there (num_pending); None: read from the sequences."""
        if not is_prefill and not all_rows and self.graphs is not None and self.graphs.fits(len(seqs)):
            # decode graphs build the step's inputs from the sequences (pinned memory, one copy), plan, replay
            if self.state_layers and self.debug:
                self._state_debug([s.state_slot for s in seqs], [True] * len(seqs), False)
            return self.model.compute_logits(self.graphs.run(seqs, input_ids)).float()
        ids, pos, ctx, last_rows = self.prepare(seqs, is_prefill)
        if input_ids is not None:
            ids = input_ids
        try:
            embeds = self.prefill_embeds(seqs, ids, ctx) if is_prefill else None
            if getattr(self, "_planned", None) is not None:   # async scheduling plans while the previous step may not
                self._planned.synchronize()             # have run: its plan's pinned host buffers must be read
            self.backend.plan(ctx)                      # once per step; every layer reuses the plan
            if self.device.type == "cuda":
                self._planned = torch.cuda.Event()
                self._planned.record()
            set_context(ctx)
            if getattr(self, "num_state_slots", 0) and self.debug:
                self._state_debug(ctx.state_slots_cpu, ctx.state_continue_cpu, is_prefill)
            if is_prefill and self.prefill_graphs is not None and self.prefill_graphs.fits(ids.shape[0]):
                hidden = self.prefill_graphs.run(ids, pos, ctx, embeds)
            else:
                hidden = self.forward(ids, pos, ctx, embeds)
            rows = hidden if all_rows else hidden[last_rows]
            return self.model.compute_logits(rows).float()
        finally:
            reset_context()
            self.after_step(ctx)

    @torch.inference_mode()
    def _state_debug(self, slots: list, continues: list, is_prefill: bool) -> None:
        """Test-only sensitivity arms of the recurrent state pool: `zero_state_at_decode` zeros every state of the
        step's sequences before a decode step (eager or graph; or, given a list of state names such as `("ssm",)`, only those);
        `drop_conv_state_at_chunk` zeros the `conv` states of sequences that continue a prompt in a later prefill
        chunk. Either must change the tokens (the state carries)."""
        cont = [sl for sl, c in zip(slots, continues) if c]
        if not cont:
            return
        names = ()
        if not is_prefill and self.debug.get("zero_state_at_decode"):
            sel = self.debug["zero_state_at_decode"]          # True: every state; a list: those states only
            names = None if sel is True else tuple(sel)
        elif is_prefill and self.debug.get("drop_conv_state_at_chunk"):
            names = ("conv",)
        if names == ():
            return
        idx = torch.tensor(cont, dtype=torch.int64, device=self.device)
        for m in self.state_layers:
            for name, t in m.states.items():
                if names is None or name in names:
                    t[idx] = 0

    @torch.inference_mode()
    def decode_greedy(self, seqs: list[Sequence], prev_tokens: Optional[torch.Tensor] = None,
                      rows: Optional[list[int]] = None) -> torch.Tensor:
        """A greedy decode step whose tokens stay on the device: sampler.greedy_argmax's (argmax, argmax or -1 where
        the logits are not finite) of each sequence, [B] int64 each, not read
        back (the engine's async scheduling reads it while the next step runs). `prev_tokens`: the previous
        step's device tokens, this step's inputs (`rows`: the row of each sequence there; None: the same
        sequences in the same order); None: each sequence's last known token."""
        ids = None
        if prev_tokens is not None:
            ids = prev_tokens if rows is None else prev_tokens.index_select(
                0, torch.tensor(rows, dtype=torch.int64).to(prev_tokens.device, non_blocking=True))
        return greedy_argmax(self.run(seqs, False, input_ids=ids))

    def forward(self, ids, pos, ctx, embeds):
        return self.model(ids, pos, embeds)
