"""Sensitivity arms of the attention-only / MoE families added by spec (specs/hy_v3.yaml, ...): perturbing or
switching a feature changes transformers' output, and the engine serves the changed checkpoint alike."""
from __future__ import annotations

import pytest
import torch
from test_norm_dataflow import _arm, _edit_tensors


@pytest.mark.slow
def test_hy_v3_shared_expert_bias_matters(tiny_checkpoint, tmp_path):
    """Hy3's shared MLP carries biases where mlp_bias is set (`shared_expert.bias`): perturbing only the shared
    MLP's biases moves transformers' tokens, and the engine follows."""
    base = tiny_checkpoint("HYV3ForCausalLM", overrides={"mlp_bias": True})
    g = torch.Generator().manual_seed(11)

    def edit(name, t):
        return 2.0 * torch.randn(t.shape, generator=g) if ".mlp.shared_mlp." in name and name.endswith(".bias") else None
    _arm(base, _edit_tensors(base, tmp_path / "hy_v3_shared_bias", edit), "perturbing the shared MLP's biases")


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["self_attn.attn_sub_norm", "mlp.ffn_sub_norm"])
def test_bitnet_sub_norm_weights_matter(tiny_checkpoint, tmp_path, norm):
    """BitNet's sub-norms (`sub_norm` of the attention / the gated MLP): scaling one norm's weight per column moves
    transformers' tokens, and the engine follows (at TP 1 here; the conformance battery runs TP 2)."""
    base = tiny_checkpoint("BitNetForCausalLM")
    g = torch.Generator().manual_seed(12)

    def edit(name, t):
        return t * (0.2 + 2.0 * torch.rand(t.shape, generator=g)) if name.endswith(f".{norm}.weight") else None
    _arm(base, _edit_tensors(base, tmp_path / f"bitnet_{norm}", edit), f"perturbing {norm}")


def test_bitnet_ternary_checkpoints_are_refused_by_name():
    """The released BitNet checkpoints quantize weights and activations at run time (quant_method 'bitnet'):
    specs/bitnet.yaml serves the full-precision architecture only, and the runtime refuses the method by name."""
    from xllm_gen.runtime.loading.quant_config import QuantConfigError, parse_quant_config
    hf = {"architectures": ["BitNetForCausalLM"], "quantization_config": {
        "quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"}}
    with pytest.raises(QuantConfigError, match="bitnet"):
        parse_quant_config(hf)


def test_transformer_sinusoidal_table_is_ctrls_and_not_fairseqs():
    """`embed_positions: {kind: sinusoidal, frequencies: transformer}` is transformers' CTRL table exactly (odd
    widths too), and differs from the fairseq table (the default), so the key matters."""
    from transformers.models.ctrl.modeling_ctrl import positional_encoding

    from xllm_gen.runtime.layers.embedding import sinusoidal_table, transformer_sinusoidal_table
    for dim in (16, 17, 64):
        ours = transformer_sinusoidal_table(300, dim)
        assert torch.equal(ours, positional_encoding(300, dim, torch.float))
        assert (ours - sinusoidal_table(300, dim)).abs().max() > 0.1


@pytest.mark.slow
def test_gpt_neox_japanese_last_layer_out_bias_matters(tiny_checkpoint, tmp_path):
    """GPT-NeoX-Japanese's output-projection bias on the last layer only (`out.bias` reading `layer`; zeros in the
    tiny checkpoint): other values move transformers' tokens, and the engine follows."""
    base = tiny_checkpoint("GPTNeoXJapaneseForCausalLM")
    g = torch.Generator().manual_seed(13)

    def edit(name, t):
        return 3.0 * torch.randn(t.shape, generator=g) if name.endswith("attention.dense_bias") else None
    _arm(base, _edit_tensors(base, tmp_path / "gnj_dense_bias", edit), "perturbing the last layer's dense_bias")


@pytest.mark.slow
def test_axk1_moe_out_norm_weights_matter(tiny_checkpoint, tmp_path):
    """A.X-K1's norm of the MoE output (`moe.out_norm`, stored as the layer's post_mlp_layernorm): scaling its
    weight per column moves transformers' tokens, and the engine follows."""
    base = tiny_checkpoint("AXK1ForCausalLM")
    g = torch.Generator().manual_seed(14)

    def edit(name, t):
        return t * (0.2 + 2.0 * torch.rand(t.shape, generator=g)) if name.endswith("post_mlp_layernorm.weight") else None
    _arm(base, _edit_tensors(base, tmp_path / "axk1_out_norm", edit), "perturbing post_mlp_layernorm")


@pytest.mark.slow
def test_diffllama_lambdas_matter(tiny_checkpoint, tmp_path):
    """Differential attention's lambda vectors (lambda_q1 / k1 / q2 / k2): scaling them moves transformers' tokens,
    and the engine follows."""
    base = tiny_checkpoint("DiffLlamaForCausalLM")

    def edit(name, t):
        return 6.0 * t if ".self_attn.lambda_" in name else None
    _arm(base, _edit_tensors(base, tmp_path / "diffllama_lambdas", edit), "scaling the lambda vectors")


def test_differential_attention_is_refused_on_cuda_and_at_tp2():
    """Differential attention runs its value halves as one value head of 2 * head_dim: the CUDA path refuses value
    heads wider than q/k at load, naming them; a tensor-parallel split by heads is refused at construction."""
    import types
    from unittest import mock

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.model_runner import ModelRunner
    attn = L.Attention(4, 2, 16, scale=0.25, v_head_dim=32)
    runner = types.SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=[attn])
    with pytest.raises(NotImplementedError, match="value heads of another width"):
        ModelRunner._make_backend(runner)
    with mock.patch("xllm_gen.runtime.layers.attention.get_tp_size", return_value=2):
        with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
            L.DifferentialAttention(4, 2, 16, 1e-5, 0)
