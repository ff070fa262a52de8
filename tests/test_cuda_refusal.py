"""The CUDA attention path refuses at load, naming the feature, what FlashInfer cannot run: a head_dim its
paged prefill / decode kernels are not built for (GPT-J's tiny head_dim 16 failed inside FlashInfer on an H200),
attention sinks. Decided on the CPU: the backend choice runs before any kernel, so no GPU is needed."""
from __future__ import annotations

import types

import pytest
import torch

from xllm_gen.runtime.attention.base import FLASHINFER_HEAD_DIMS, cuda_attention_refusal, make_variant
from xllm_gen.runtime.executor.model_runner import ModelRunner


def _runner_on_cuda(head_dims, sinks=False, chunk_size=None):
    layers = [types.SimpleNamespace(head_dim=d, num_heads=4, num_kv_heads=2, scale=d ** -0.5,
                                    variant=make_variant(sinks=sinks, chunk_size=chunk_size)) for d in head_dims]
    return types.SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=layers)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 112, 160, 192])
def test_unsupported_head_dim_is_refused_by_name(head_dim):
    with pytest.raises(NotImplementedError, match=f"head_dim {head_dim} is not one FlashInfer"):
        ModelRunner._make_backend(_runner_on_cuda([head_dim, head_dim]))


def test_one_unsupported_layer_is_enough():
    msg = cuda_attention_refusal([128, 128, 80])
    assert msg is not None and "head_dim 80" in msg


@pytest.mark.parametrize("head_dim", FLASHINFER_HEAD_DIMS)
def test_supported_head_dims_pass(head_dim):
    assert cuda_attention_refusal([head_dim] * 3) is None


def test_sinks_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="attention sinks"):
        ModelRunner._make_backend(_runner_on_cuda([64], sinks=True))


def test_chunked_attention_is_refused_by_name():
    """Llama 4's chunked local attention: FlashInfer's wrappers as planned here mask causally (with at most a
    sliding window), so a model with a chunked layer is refused on CUDA at load, naming it; the CPU serves it."""
    with pytest.raises(NotImplementedError, match="chunked local attention"):
        ModelRunner._make_backend(_runner_on_cuda([64], chunk_size=8))
    runner = _runner_on_cuda([64], chunk_size=8)
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_cpu_serves_any_head_dim():
    runner = _runner_on_cuda([16])
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_per_layer_attention_shapes_are_refused_by_name():
    """Layers of different (heads, kv_heads, head_dim) (Laguna's per-layer head counts, MiMo-V2-Flash's doubled KV
    heads on its sliding layers): the FlashInfer backend plans one shape per step, so CUDA refuses them at load,
    naming the shapes; the CPU serves them."""
    runner = _runner_on_cuda([128, 128])
    runner.attn_layers[1].num_heads = 2
    with pytest.raises(NotImplementedError, match="different shapes per layer .*2 heads, 2 KV heads, head_dim 128"):
        ModelRunner._make_backend(runner)
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_value_head_dim_is_refused_by_name():
    """Value heads of another width than q / k (an attention `v_head_dim`): FlashInfer's decode wrapper takes one
    head_dim, so CUDA refuses at load, naming both widths."""
    runner = _runner_on_cuda([128])
    runner.attn_layers[0].qk_head_dim, runner.attn_layers[0].v_head_dim = 128, 64
    with pytest.raises(NotImplementedError, match=r"value heads of another width \(64\) than its query / key heads"):
        ModelRunner._make_backend(runner)
