"""Kimi Linear (specs/kimi_linear.yaml): Kimi Delta Attention (KDA, `gated_delta_net` with `decay: channel`,
`gate_activation: sigmoid`, low-rank projections) around NoPE MLA layers, DeepSeek-V3's MoE.

- the delta-rule core with a per-key-channel decay against transformers' own torch references
  (chunk_kimi_delta_attention / recurrent_kimi_delta_attention), also over a prompt split in two chunks;
- slow: greedy parity with transformers float32 on the tiny checkpoint with chunked prefill (chunks of 5 tokens) over
  concurrent sequences (each sequence's state continues from its slot across chunks; the mixer's slot handling is
  tests/test_recurrent.py's by default, the per-channel core across a split prompt is checked here by default);
- sensitivity: the decay collapsed to one value per head (its mean over the key channels) changes the core's output
  (default), and the model's tokens, as does the output gate's sigmoid swapped for silu (slow: two engine runs);
- the config guard: the released config.json form (linear_attn_config, first_k_dense_replace, model_max_length,
  the original MoE field names) is read as transformers reads it, and what the spec does not model is refused by
  name (a layer in neither KDA nor full-attention list, MLA with rotary, K/V heads fewer than heads);
- slow: TP 2 with chunked prefill.
The plain parity arms (TP 1, TP 2) and the features-ON config are the spec / conformance batteries'.
"""
from __future__ import annotations

import json

import pytest
import torch

ARCH = "KimiLinearForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


# ------------------------------------------------------------------------------------------------ the core
def test_per_channel_delta_rule_matches_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    from xllm_gen.runtime.layers.recurrent import gated_delta_rule_chunked, gated_delta_rule_step
    torch.manual_seed(0)
    T, H, Dk, Dv = 21, 3, 8, 6
    q, k, v = torch.randn(T, H, Dk), torch.randn(T, H, Dk), torch.randn(T, H, Dv)
    g, beta = -torch.rand(T, H, Dk) * 2, torch.rand(T, H)
    s0 = torch.randn(H, Dk, Dv) * 0.1
    want, want_s = chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], chunk_size=8,
                                              initial_state=s0[None], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    rec, _ = recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(rec, want, atol=1e-5, rtol=1e-5)
    out, s = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=4)        # chunks shorter than the prompt
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s[0], atol=1e-5, rtol=1e-5)
    o1, s1 = gated_delta_rule_chunked(q[:13], k[:13], v[:13], g[:13], beta[:13], s0)   # a prompt in two pieces
    o2, s2 = gated_delta_rule_chunked(q[13:], k[13:], v[13:], g[13:], beta[13:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, want_s[0], atol=1e-5, rtol=1e-5)
    st, outs = s0[None], []
    for t in range(T):                                                            # decode steps
        o, st = gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], st)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), want[0], atol=1e-5, rtol=1e-5)
    # a per-head decay broadcast over the channels is the per-head form (one core for both)
    gh = -torch.rand(T, H)
    a, _ = gated_delta_rule_chunked(q, k, v, gh, beta, s0)
    b, _ = gated_delta_rule_chunked(q, k, v, gh[..., None].expand(T, H, Dk).contiguous(), beta, s0)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the per-channel decay matters: its per-head mean gives another output
    c, _ = gated_delta_rule_chunked(q, k, v, g.mean(-1, keepdim=True).expand_as(g).contiguous(), beta, s0)
    assert (c - want[0]).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------- the model
def _hf_tokens(ckpt, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    import transformers
    model = transformers.KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def _engine_tokens(ckpt, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH)


@pytest.fixture(scope="module")
def want(ckpt):
    return _hf_tokens(ckpt)


@pytest.mark.slow
def test_chunked_prefill_concurrent_sequences(ckpt, want):
    assert _engine_tokens(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=3) == want


@pytest.mark.slow
def test_per_channel_decay_and_sigmoid_gate_matter(ckpt, want, monkeypatch):
    """Sensitivity: the KDA decay collapsed to one value per head, or its gated norm's sigmoid made silu (the
    Gated DeltaNet forms), changes the greedy tokens of the tiny checkpoint."""
    import xllm_gen.runtime.layers.recurrent as R
    chunked, step = R.gated_delta_rule_chunked, R.gated_delta_rule_step

    def per_head(g):
        return g.mean(-1, keepdim=True).expand_as(g).contiguous() if g.dim() == 3 else g
    with monkeypatch.context() as m:
        m.setattr(R, "gated_delta_rule_chunked", lambda q, k, v, g, *a, **kw: chunked(q, k, v, per_head(g), *a, **kw))
        m.setattr(R, "gated_delta_rule_step", lambda q, k, v, g, *a: step(q, k, v, per_head(g), *a))
        assert _engine_tokens(ckpt) != want, "collapsing the per-channel decay to per head did not change the tokens"
    with monkeypatch.context() as m:
        m.setattr(R.GatedRMSNorm, "__init__", _silu_norm_init(R.GatedRMSNorm.__init__))
        assert _engine_tokens(ckpt) != want, "a silu output gate instead of sigmoid did not change the tokens"


def _silu_norm_init(init):
    def patched(self, dim, eps, activation="silu"):
        init(self, dim, eps, "silu")
    return patched


@pytest.mark.slow
def test_tp2_chunked_prefill(ckpt, want):
    assert _engine_tokens(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=5) == want


# ------------------------------------------------------------------------------------------------ the guard
# the released config.json's form (Kimi-Linear-48B-A3B-Instruct), shrunk: linear_attn_config with 1-based layer
# lists, first_k_dense_replace, model_max_length, the original MoE field names, fields transformers does not read
RELEASED = {
    "architectures": [ARCH], "model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "head_dim": 72, "rms_norm_eps": 1e-5, "model_max_length": 1048576, "hidden_act": "silu",
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "moe_layer_freq": 1,
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 2, "mla_use_nope": True, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "eos_token_id": 163586,
    "bos_token_id": 163584, "pad_token_id": 163839, "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "linear_attn_config": {"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "head_dim": 8, "num_heads": 4,
                           "short_conv_kernel_size": 4},
}


def _config(cfg):
    from generated.kimi_linear.model import Config
    return Config.from_hf(json.loads(json.dumps(cfg)))


def _hf_config(cfg):
    import transformers
    return transformers.KimiLinearConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})


def test_released_config_is_read_as_transformers_reads_it():
    c, h = _config(RELEASED), _hf_config(RELEASED)
    assert list(c.layer_types) == h.layer_types == ["linear_attention", "linear_attention", "full_attention",
                                                    "linear_attention", "full_attention"]
    assert list(c.mlp_layer_types) == h.mlp_layer_types == ["dense", "dense", "sparse", "sparse", "sparse"]
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim) == (4, 8, 4)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.norm_topk_prob) == (8, 2, 1, True)
    assert c.q_lora_rank is None and c.max_position_embeddings == 1048576
    # without both lists transformers falls back to its pattern (every 4th layer after the first full), as here
    for partial in ({"kda_layers": [1, 2, 4]}, {}):
        cfg = {**RELEASED, "linear_attn_config": {"head_dim": 8, "num_heads": 4, **partial}}
        assert list(_config(cfg).layer_types) == _hf_config(cfg).layer_types


@pytest.mark.parametrize("edit, field", [
    ({"linear_attn_config": {**RELEASED["linear_attn_config"], "kda_layers": [1, 2]}}, "layer_types"),  # layer 4
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"use_grouped_topk": False}, "use_grouped_topk"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_attn_config": {**RELEASED["linear_attn_config"], "short_conv_kernel_size": 1}}, "short_conv_kernel_size"),
])
def test_guard_refuses_by_name(edit, field):
    with pytest.raises(ValueError, match=field) as e:
        _config({**RELEASED, **edit})
    assert "kimi_linear.yaml" in str(e.value)


# ------------------------------------------------------------------------------------------------ the loader
def test_checkpoint_renames_and_squeezed_unit_dims(tmp_path):
    """checkpoint_renames: names rewritten by the first matching pattern, the tensor still read under its stored
    name; two tensors renamed onto one name are refused naming both. squeeze: [0, 1, 3] reads [1, 1, H, 1] as [H]
    (slices included), and refuses a shape without those unit dims."""
    from safetensors.torch import save_file

    from xllm_gen.runtime.loading.loader import Checkpoint, CheckpointError
    from xllm_gen.runtime.loading.weights import TensorLayout, WeightLoadError
    save_file({"l.0.block_sparse_moe.w": torch.arange(6.0).reshape(1, 1, 6, 1), "l.1.mlp.w": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path, [(r"\.block_sparse_moe\.", ".mlp.")])
    assert sorted(ck.names()) == ["l.0.mlp.w", "l.1.mlp.w"]
    view = TensorLayout("l.0.mlp.w", squeeze=(0, 1, 3)).view(ck.slice("l.0.mlp.w"))
    assert view.get_shape() == [6] and view[2:5].tolist() == [2.0, 3.0, 4.0]
    with pytest.raises(WeightLoadError, match=r"unit dims at \[0, 1\]"):
        TensorLayout("x", squeeze=(0, 1)).view(ck.slice("l.1.mlp.w"))
    # only the first matching pattern applies: l.1.mlp.w matches the first (unchanged), not the second
    assert sorted(Checkpoint(tmp_path, [(r"\.(block_sparse_moe|mlp)\.", ".mlp."), (r"^l\.1\.", "l.0.")]).names()) == \
        ["l.0.mlp.w", "l.1.mlp.w"]
    with pytest.raises(CheckpointError, match="both read as 'l.0.mlp.w'"):
        Checkpoint(tmp_path, [(r"\.block_sparse_moe\.", ".mlp."), (r"^l\.1\.", "l.0.")])
