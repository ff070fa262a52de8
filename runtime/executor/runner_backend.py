"""The runner's attention backend (a ModelRunner base): on CUDA, FlashInfer (one backend per shape group of the
attention layers), after refusing by name what the CUDA attention path does not implement (sparse-attention
indexers, per-key score biases, value heads of another width, ALiBi, per-layer scales, shared KV, head dims / chunked attention the
kernels lack); elsewhere, or with debug torch_attention, the torch paged attention.
"""
from __future__ import annotations

import logging

from xllm_gen.runtime import layers as L

logger = logging.getLogger("xllm_gen")


class RunnerAttentionBackend:
    def _pad_head_dims(self) -> None:
        """On the CUDA attention path, layers whose head dim the kernels lack are served zero-padded to the next one
        they have (runtime/attention/base.py padded_head_dim); debug `pad_head_dim` (a width) pads every layer on
        any device (tests: the padded path against the plain one on the CPU). Before the KV cache is allocated."""
        from xllm_gen.runtime.attention.base import padded_head_dim
        forced = self.debug.get("pad_head_dim")
        cuda = self.device.type == "cuda" and not self.debug.get("torch_attention")
        for layer in self.attn_layers:
            if getattr(layer, "qk_head_dim", layer.head_dim) != getattr(layer, "v_head_dim", layer.head_dim) \
                    or getattr(layer, "kv_readers", None):
                continue                  # refused on CUDA by name (_make_backend); never padded
            width = int(forced) if forced else padded_head_dim(layer.head_dim) if cuda else None
            if width is not None and width != layer.head_dim:
                layer.pad_head_dim(width)
        padded = sorted({(m.model_head_dim, m.head_dim) for m in self.attn_layers
                         if getattr(m, "model_head_dim", None) is not None})
        if padded:
            logger.info("attention heads served zero-padded (model head_dim -> kernel head_dim): %s; the KV cache "
                        "is that much wider", ", ".join(f"{a} -> {b}" for a, b in padded))

    def _make_backend(self):
        from xllm_gen.runtime.attention.flashinfer_backend import prefill_attention_choice
        if self.device.type == "cuda" and not self.debug.get("torch_attention") and self.attn_layers:
            if any(isinstance(m, L.ValueKeyBias) for m in getattr(self, "index_layers", None) or ()):
                raise NotImplementedError(
                    "this model adds a learned per-key bias to the attention scores, computed from the values "
                    "(an attention `key_bias`), which the CUDA attention path (FlashInfer paged "
                    "prefill / decode wrappers) takes no operand for; serve it on the CPU (device='cpu')")
            if getattr(self, "index_layers", None):
                raise NotImplementedError(
                    "this model uses a sparse-attention indexer (each query attends to the top-k keys an indexer "
                    "scores: an indexer block), whose key selection the CUDA attention path (FlashInfer paged prefill "
                    "/ decode wrappers: a causal mask with at most a sliding window) does not take; serve it on the "
                    "CPU (device='cpu')")
            mixed = [layer for layer in self.attn_layers
                     if getattr(layer, "qk_head_dim", layer.head_dim) != getattr(layer, "v_head_dim", layer.head_dim)]
            if mixed:
                raise NotImplementedError(
                    f"this model's attention has value heads of another width ({mixed[0].v_head_dim}) than its "
                    f"query / key heads ({mixed[0].qk_head_dim}) (an attention `v_head_dim`, as MiMo-V2-Flash's; "
                    "multi-head latent attention's latent cache or per-head K/V); the CUDA attention path (FlashInfer's "
                    "paged decode wrapper: one head_dim for q, k and v) does not run it; serve it on the CPU "
                    "(device='cpu')")
            if any(getattr(layer.variant, "alibi", False) for layer in self.attn_layers):
                raise NotImplementedError(
                    "this model uses ALiBi (a per-head linear position bias on the attention scores), which the CUDA "
                    "attention path (FlashInfer paged prefill / decode wrappers as planned here, the Triton decode "
                    "kernel) does not implement; serve it on the CPU (device='cpu')")
            scales = sorted({layer.scale for layer in self.attn_layers if hasattr(layer, "scale")})
            if len(scales) > 1:
                raise NotImplementedError(
                    f"this model's attention scale differs between layers ({scales[0]:g} .. {scales[-1]:g}: a "
                    "per-layer attention scale, e.g. GPT-2's scale_attn_by_inverse_layer_idx), which the CUDA "
                    "attention path (one FlashInfer plan per step, one sm_scale) does not implement; serve it on the "
                    "CPU (device='cpu')")
            from xllm_gen.runtime.attention.base import cuda_attention_refusal
            if getattr(self, "kv_reader_layers", ()):    # (a stub runner of the tests may lack it)
                raise NotImplementedError(cuda_attention_refusal((), shared_kv=True))
            refusal = cuda_attention_refusal((layer.head_dim for layer in self.attn_layers),
                                             chunked=any(getattr(layer.variant, "chunk_size", None) is not None
                                                         for layer in self.attn_layers))
            if refusal:
                raise NotImplementedError(refusal)
            from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
            from xllm_gen.runtime.attention.shape_groups import ShapeGroupBackend, layer_shape
            from xllm_gen.runtime.executor.cuda_graph import graph_buckets
            shapes = list(dict.fromkeys(layer_shape(layer) for layer in self.attn_layers))
            if len(shapes) > 1:
                # layers of different shapes: one FlashInfer backend per shape group (shape_groups.py), eager (the
                # decode graphs are built around one backend's wrappers); the groups share the largest workspace
                logger.warning("attention layers of %d shapes %s: one FlashInfer backend per shape, without CUDA "
                               "graphs", len(shapes), shapes)
                self.enforce_eager = True
                shapes.sort(key=lambda s: -FlashInferBackend.workspace_size(*s, self.max_num_seqs,
                                                                            self.max_num_batched_tokens))
            a = self.attn_layers[0]
            buckets = () if self.enforce_eager else graph_buckets(self.graph_buckets, self.max_num_seqs)
            groups: dict = {}
            max_batch = max((self.max_num_seqs,) + buckets)
            for H, Hk, D in shapes:
                first = next(iter(groups.values()), None)
                share = first is not None and FlashInferBackend.workspace_size(
                    H, Hk, D, max_batch, self.max_num_batched_tokens, first.num_sms) <= first.workspace_bytes
                groups[(H, Hk, D)] = FlashInferBackend(
                    num_heads=H, num_kv_heads=Hk, head_dim=D, block_size=self.block_size, dtype=self.dtype,
                    device=self.device, max_batch=max_batch,
                    max_model_len=self.max_model_len, max_num_blocks=self.num_kv_blocks,
                    max_num_tokens=self.max_num_batched_tokens, graph_buckets=buckets, sm_scale=a.scale,
                    kv_dtype=self.kv_dtype, decode_tensor_cores=self.debug.get("decode_tensor_cores"),
                    decode_kernel=self.debug.get("decode_attention"),
                    prefill_backend=prefill_attention_choice(self.debug.get("prefill_attention")),
                    workspace=first.workspace if share else None)
            return next(iter(groups.values())) if len(groups) == 1 else ShapeGroupBackend(groups)
        from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
        return TorchPagedBackend()
