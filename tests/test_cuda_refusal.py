"""The CUDA attention path refuses at load, naming the feature, what FlashInfer cannot run: a head_dim past the
largest its paged prefill / decode kernels are built for (smaller ones it lacks, e.g. GPT-J's tiny 16, which failed
inside FlashInfer on an H200, are served zero-padded),
chunked local attention, KV sharing across layers, a sparse-attention indexer, value heads of another width.
Decided on the CPU: the backend choice runs before any kernel, so no GPU is needed."""
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


@pytest.mark.parametrize("head_dim", [320, 512])
def test_head_dim_past_the_kernels_is_refused_by_name(head_dim):
    with pytest.raises(NotImplementedError, match=f"head_dim {head_dim} is larger than FlashInfer"):
        ModelRunner._make_backend(_runner_on_cuda([head_dim, head_dim]))


def test_one_unsupported_layer_is_enough():
    msg = cuda_attention_refusal([128, 128, 320])
    assert msg is not None and "head_dim 320" in msg


@pytest.mark.parametrize("head_dim", FLASHINFER_HEAD_DIMS)
def test_supported_head_dims_pass(head_dim):
    assert cuda_attention_refusal([head_dim] * 3) is None


@pytest.mark.parametrize("head_dim,width", [(16, 64), (32, 64), (80, 128), (96, 128), (112, 128), (160, 256),
                                            (192, 256), (64, 64), (256, 256)])
def test_smaller_head_dims_are_padded_not_refused(head_dim, width):
    """Phi-2's 80, Phi-3-mini's 96, ...: served on CUDA with heads zero-padded to the next kernel head dim
    (tests/test_padded_heads.py checks the padded attention against the plain one)."""
    from xllm_gen.runtime.attention.base import padded_head_dim
    assert cuda_attention_refusal([head_dim]) is None and padded_head_dim(head_dim) == width


def test_sinks_are_not_refused():
    """Attention sinks are served on CUDA (runtime/attention/flashinfer_run.py; tests/test_attention_epilogue.py):
    only the head_dim decides here."""
    assert cuda_attention_refusal([64]) is None
    with pytest.raises(NotImplementedError, match="head_dim 320 is larger than FlashInfer"):
        ModelRunner._make_backend(_runner_on_cuda([320], sinks=True))


def test_chunked_attention_is_refused_by_name():
    """Llama 4's chunked local attention: FlashInfer's wrappers as planned here mask causally (with at most a
    sliding window), so a model with a chunked layer is refused on CUDA at load, naming it; the CPU serves it."""
    with pytest.raises(NotImplementedError, match="chunked local attention"):
        ModelRunner._make_backend(_runner_on_cuda([64], chunk_size=8))
    runner = _runner_on_cuda([64], chunk_size=8)
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_sparse_indexer_is_refused_by_name():
    """A sparse-attention indexer (DeepSeek-V3.2, GLM-MoE-DSA): the CUDA attention path takes no per-query key
    selection, so the model is refused on CUDA at load, naming the indexer (before MLA's value-width refusal); the CPU
    backend serves it."""
    runner = _runner_on_cuda([64])
    runner.index_layers = [object()]
    with pytest.raises(NotImplementedError, match="sparse-attention indexer"):
        ModelRunner._make_backend(runner)
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_cpu_serves_any_head_dim():
    runner = _runner_on_cuda([16])
    runner.device = torch.device("cpu")
    assert type(ModelRunner._make_backend(runner)).__name__ == "TorchPagedBackend"


def test_per_layer_attention_shapes_get_one_backend_per_shape(monkeypatch):
    """Layers of different (heads, kv_heads, head_dim) (Laguna's per-layer head counts): the CUDA runner builds one
    FlashInfer backend per shape group (planned and run as for a model of that one shape; a ShapeGroupBackend
    dispatches each layer to its shape's), the largest group's workspace shared, and runs eagerly (no decode graphs).
    FlashInfer itself is replaced by a recorder here: the wiring is checked on the CPU, the kernels on a GPU host."""
    import xllm_gen.runtime.attention.flashinfer_backend as fb
    from xllm_gen.runtime.attention.shape_groups import ShapeGroupBackend

    made = []

    class Recorder:
        workspace_size = staticmethod(fb.FlashInferBackend.workspace_size)

        def __init__(self, **kw):
            self.kw, self.num_sms = kw, 132
            self.workspace = kw["workspace"] if kw["workspace"] is not None else object()
            self.workspace_bytes = 1 << 40
            made.append(self)

    monkeypatch.setattr(fb, "FlashInferBackend", Recorder)
    runner = _runner_on_cuda([128, 128, 128])
    runner.attn_layers[1].num_heads = 2
    runner.__dict__.update(enforce_eager=False, graph_buckets=(1, 2), max_num_seqs=4, block_size=16,
                           dtype=torch.bfloat16, max_model_len=64, num_kv_blocks=32, max_num_batched_tokens=256,
                           kv_dtype=torch.bfloat16)
    backend = ModelRunner._make_backend(runner)
    assert isinstance(backend, ShapeGroupBackend) and sorted(backend.groups) == [(2, 2, 128), (4, 2, 128)]
    assert runner.enforce_eager and all(m.kw["graph_buckets"] == () for m in made)
    assert {(m.kw["num_heads"], m.kw["num_kv_heads"], m.kw["head_dim"]) for m in made} == {(4, 2, 128), (2, 2, 128)}
    assert made[0].kw["workspace"] is None and made[1].kw["workspace"] is made[0].workspace   # one shared workspace


def test_shape_group_backend_dispatches_by_layer_shape():
    """ShapeGroupBackend over the torch backend: two layers of different shapes in one step, each computed by its
    shape's backend, equal to the plain backend's output."""
    from xllm_gen.runtime.attention.shape_groups import ShapeGroupBackend
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.executor.context import ForwardContext

    torch.manual_seed(0)
    ctx = ForwardContext(is_prefill=True, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                         seq_lens=torch.tensor([5], dtype=torch.int32), slot_mapping=torch.arange(5),
                         block_tables=torch.tensor([[0, 1]], dtype=torch.int32), block_size=4, seq_lens_cpu=[5],
                         query_lens_cpu=[5])
    calls = []

    class Counting(TorchPagedBackend):
        def forward(self, q, *a, **kw):
            calls.append(tuple(q.shape[1:]))
            return super().forward(q, *a, **kw)

    groups = ShapeGroupBackend({(4, 2, 8): Counting(), (2, 2, 16): Counting()})
    groups.plan(ctx)
    plain = TorchPagedBackend()
    plain.plan(ctx)
    for H, Hk, D in ((4, 2, 8), (2, 2, 16)):
        q, k, v = torch.randn(5, H, D), torch.randn(5, Hk, D), torch.randn(5, Hk, D)
        kc, vc = torch.zeros(2, 4, Hk, D), torch.zeros(2, 4, Hk, D)
        kc.view(-1, Hk, D)[:5], vc.view(-1, Hk, D)[:5] = k, v
        torch.testing.assert_close(groups.forward(q, k, v, kc, vc, ctx, 0.3), plain.forward(q, k, v, kc, vc, ctx, 0.3))
    assert calls == [(4, 8), (2, 16)]
    with pytest.raises(RuntimeError, match="no planned backend"):
        groups.forward(torch.randn(5, 8, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), kc, vc, ctx, 0.3)


def test_value_head_dim_is_refused_by_name():
    """Value heads of another width than q / k (an attention `v_head_dim`): FlashInfer's decode wrapper takes one
    head_dim, so CUDA refuses at load, naming both widths."""
    runner = _runner_on_cuda([128])
    runner.attn_layers[0].qk_head_dim, runner.attn_layers[0].v_head_dim = 128, 64
    with pytest.raises(NotImplementedError, match=r"value heads of another width \(64\) than its query / key heads"):
        ModelRunner._make_backend(runner)


def test_key_bias_is_refused_by_name():
    """A per-key score bias from the values (attention.key_bias, Doge): the CUDA attention path takes no bias
    operand, so the model is refused on CUDA at load, naming the bias."""
    from xllm_gen.runtime.layers.key_bias import ValueKeyBias
    runner = _runner_on_cuda([128, 128])
    runner.index_layers = [ValueKeyBias(2, keep=4)]
    with pytest.raises(NotImplementedError, match="per-key bias to the attention scores"):
        ModelRunner._make_backend(runner)
