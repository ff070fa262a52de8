"""Attention backends behind one interface: TorchPagedBackend (CPU, oracle), FlashInferBackend (CUDA)."""
from xllm_gen.runtime.attention.base import FULL, AttentionBackend, AttentionVariant, attention_variants, make_variant
from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend

__all__ = ["AttentionBackend", "AttentionVariant", "FULL", "attention_variants", "make_variant",
           "TorchPagedBackend", "FlashInferBackend"]


def __getattr__(name):
    if name == "FlashInferBackend":
        from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend
    raise AttributeError(name)
