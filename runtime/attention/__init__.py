"""Attention backends behind one interface: TorchPagedBackend (CPU, oracle), FlashInferBackend (CUDA)."""
from xllm_gen.runtime.attention.base import AttentionBackend
from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend

__all__ = ["AttentionBackend", "TorchPagedBackend", "FlashInferBackend"]


def __getattr__(name):
    if name == "FlashInferBackend":
        from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend
    raise AttributeError(name)
