"""Qwen v1 (QWenLMHeadModel, model_type "qwen"; remote code: transformers ships no class) served by specs/qwen.yaml,
against a plain-PyTorch reference written from modeling_qwen.py: `c_attn` split `[hidden] * 3` ([q | k | v], with
bias), `apply_rotary_pos_emb` (rotate_half over the whole head, `inv_freq = 1 / base ** (arange(0, d, 2) / d)`),
`mlp.c_proj(w1(x) * silu(w2(x)))` (w2 gated), RMSNorms ln_1 / ln_2 / ln_f, `transformer.wte`, an untied `lm_head`;
and its long-context devices, `use_logn_attn` (`query * logn_tensor[:, seq_start:seq_end]`, `log(i, seq_length)` for
i = position + 1 > seq_length) and `use_dynamic_ntk` (`get_ntk_alpha(kv_seq_len)`, base times
`ntk_alpha ** (d / (d - 2))`), which the spec does not model: the engine serves the context up to seq_length, where
they are the identity."""
from __future__ import annotations

import json
import math

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, D, I, V, L = 64, 4, 16, 192, 128, 2      # intermediate_size 192: w1 / w2 are 96 wide
SEQ = 24                                           # seq_length: the prompts (<= 19) plus 8 tokens reach 27 > 24
CONFIG = {
    "architectures": ["QWenLMHeadModel"], "model_type": "qwen",
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                 "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False,
    "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I, "kv_channels": D,
    "layer_norm_epsilon": 1e-6, "max_position_embeddings": 8192, "no_bias": True, "num_attention_heads": HEADS,
    "num_hidden_layers": L, "onnx_safe": None, "rotary_emb_base": 1000.0, "rotary_pct": 1.0,
    "scale_attn_weights": True, "seq_length": SEQ, "softmax_in_fp32": False, "tie_word_embeddings": False,
    "tokenizer_class": "QWenTokenizer", "transformers_version": "4.32.0", "use_cache": True,
    "use_cache_kernel": False, "use_cache_quantization": False, "use_dynamic_ntk": True, "use_flash_attn": "auto",
    "use_logn_attn": True, "vocab_size": V,
}


def _tensors(seed=5):
    g = torch.Generator().manual_seed(seed)
    f = I // 2
    t = {"transformer.wte.weight": R.rand(g, V, H, std=1.0), "transformer.ln_f.weight": R.norm_weight(g, H),
         "lm_head.weight": R.rand(g, V, H)}
    for i in range(L):
        p = f"transformer.h.{i}."
        t |= {p + "ln_1.weight": R.norm_weight(g, H), p + "ln_2.weight": R.norm_weight(g, H),
              p + "attn.c_attn.weight": R.rand(g, 3 * H, H), p + "attn.c_attn.bias": R.rand(g, 3 * H),
              p + "attn.c_proj.weight": R.rand(g, H, H),
              p + "mlp.w1.weight": R.rand(g, f, H), p + "mlp.w2.weight": R.rand(g, f, H),
              p + "mlp.c_proj.weight": R.rand(g, H, f)}
    return t


def reference(t, cfg, swap_gate=False):
    """modeling_qwen.py's forward (eager attention, no cache: the whole sequence each step, as the release's
    generate without past_key_values; kv_seq_len = the sequence length). `swap_gate`: silu on w1 instead of w2
    (a wrong reading, for the fixture's sensitivity check)."""
    eps, seq, base = cfg["layer_norm_epsilon"], cfg["seq_length"], cfg["rotary_emb_base"]

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        theta = base
        if cfg["use_dynamic_ntk"]:              # QWenModel.get_ntk_alpha / RotaryEmbedding.update_rotary_pos_emb_cache
            alpha = max(2 ** math.ceil(math.log(n / seq, 2) + 1) - 1, 1)
            theta = base * alpha ** (D / (D - 2))
        logn = torch.tensor([math.log(i, seq) if i > seq else 1.0 for i in range(1, n + 1)])
        x = t["transformer.wte.weight"][ids]
        for i in range(L):
            p = f"transformer.h.{i}."
            h = R.rms_norm(x, t[p + "ln_1.weight"], eps)
            q, k, v = (h @ t[p + "attn.c_attn.weight"].T + t[p + "attn.c_attn.bias"]).split(H, -1)
            q, k, v = q.view(n, HEADS, D), k.view(n, HEADS, D), v.view(n, HEADS, D)
            q, k = R.rope_neox(q, pos, theta), R.rope_neox(k, pos, theta)
            if cfg["use_logn_attn"]:
                q = q * logn[:, None, None]
            x = x + R.causal_attention(q, k, v, D ** -0.5) @ t[p + "attn.c_proj.weight"].T
            h = R.rms_norm(x, t[p + "ln_2.weight"], eps)
            a1, a2 = h @ t[p + "mlp.w1.weight"].T, h @ t[p + "mlp.w2.weight"].T
            a = F.silu(a1) * a2 if swap_gate else a1 * F.silu(a2)
            x = x + a @ t[p + "mlp.c_proj.weight"].T
        return R.rms_norm(x, t["transformer.ln_f.weight"], eps) @ t["lm_head.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("qwen"), CONFIG, _tensors())


def _greedy_within(forward, prompt, limit):
    """Greedy tokens until the sequence holds `limit` tokens (the engine's finish reason "length")."""
    return R.ref_greedy(forward, prompt, n=limit - len(prompt))


def test_qwen_matches_reference_within_seq_length(ckpt):
    """Within seq_length the reference with logn attention and dynamic NTK on equals the one without them, and the
    engine equals both; the engine's context is seq_length: each sequence stops there ("length")."""
    t = _tensors()
    plain = {**CONFIG, "use_dynamic_ntk": False, "use_logn_attn": False}
    on, off = reference(t, CONFIG), reference(t, plain)
    assert R.distinct(on, reference(t, CONFIG, swap_gate=True)), "fixture: which MLP half is gated matters"
    # the devices act past seq_length (the fixture would notice them there) and are the identity within it
    long_ids = torch.arange(SEQ + 9) % V
    assert not torch.allclose(on(long_ids), off(long_ids), atol=1e-3), "fixture: logn / NTK act past seq_length"
    for p in R.PROMPTS:
        ids = torch.tensor(p + [1] * (SEQ - len(p)))
        torch.testing.assert_close(on(ids), off(ids), rtol=0, atol=1e-5)
    from xllm_gen import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=R.MAX_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        assert llm.engine.max_model_len == SEQ
        outs = llm.generate([{"prompt_token_ids": p} for p in R.PROMPTS], params)
    for i, (prompt, o) in enumerate(zip(R.PROMPTS, outs)):
        out = o.outputs[0]
        n = min(R.MAX_TOKENS, SEQ - len(prompt))
        want, ref_lps = _greedy_within(on, prompt, len(prompt) + n)
        assert list(out.token_ids) == want, f"qwen prompt #{i}: engine {list(out.token_ids)} != reference {want}"
        for step, (mine, ref) in enumerate(zip(out.logprobs, ref_lps)):
            for tok, entry in mine.items():
                err = abs(R._logprob(entry) - float(ref[tok]))
                assert err < R.LOGPROB_TOL, f"qwen prompt #{i} step {step} token {tok}: logprob error {err:.3g}"
        if n < R.MAX_TOKENS:
            assert out.finish_reason == "length", out.finish_reason


def test_qwen_context_is_seq_length(ckpt):
    """A longer context than seq_length is refused (logn / NTK past it are not modeled)."""
    from xllm_gen import LLM
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(ckpt), device="cpu", dtype="float32", max_model_len=SEQ + 1)


@pytest.mark.parametrize("edit, named", [
    ({"rotary_pct": 0.5}, "rotary_pct"),
    ({"no_bias": False}, "no_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"use_cache_quantization": True}, "use_cache_quantization"),
    ({"kv_channels": 8}, "head_dim_fits"),
    ({"seq_length": None}, "seq_length"),
])
def test_qwen_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")
