"""Gemma 4 text (specs/gemma4.yaml): the primitives it added, each with a sensitivity arm. The tiny checkpoint
(tests/fixtures/tiny_hf.py: full, sliding, full layers; the full layers at head_dim 32, the sliding one at 16;
per-layer inputs 8 wide; layer_scalar uniform in [0.5, 1.5]) is checked as built by the spec and conformance
batteries. Here: the values taken from the keys (`attention_k_eq_v`, no v_proj on the full layers, one KV head
there) at TP 1; then arms that switch a feature off or corrupt it: transformers' tokens must change and the engine
must agree (checkpoint arms), or the engine must leave transformers (engine arms: the weightless v_norm has no
tensor to corrupt), or refuse by name."""
from __future__ import annotations

import importlib
import shutil

import numpy as np
import pytest
import torch

ARCH = "Gemma4ForCausalLM"
K_EQ_V = {"attention_k_eq_v": True, "final_logit_softcapping": 3.0,
          "per_layer_config": {"0": {"head_dim": 32, "num_key_value_heads": 1},
                               "2": {"head_dim": 32, "num_key_value_heads": 1}}}


def _check(ckpt, arm, seed, label):
    from test_scalings import _agree, _engine, _hf

    prompt = np.random.default_rng(seed).integers(0, 400, 12).tolist()
    base, want = _hf(ckpt, prompt), _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), f"{label} changes nothing"
    _agree(_engine(arm, prompt), want, label)


def _edit_tensors(ckpt, out, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.slow
@pytest.mark.engine
def test_values_from_keys(tiny_checkpoint):
    """attention_k_eq_v: the full layers have no v_proj and one KV head (num_key_value_heads of per_layer_config);
    their values are the keys as projected (before k_norm and rotary), RMS-normed. Greedy parity in float32."""
    from safetensors import safe_open
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH, overrides=K_EQ_V)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        v = sorted(k for k in f.keys() if k.endswith("v_proj.weight"))
    assert v == ["model.layers.1.self_attn.v_proj.weight"]       # the sliding layer only
    prompt = np.random.default_rng(3).integers(0, 400, 13).tolist()
    _agree(_engine(ckpt, prompt), _hf(ckpt, prompt), "attention_k_eq_v")


def test_values_from_keys_off_is_refused(tiny_checkpoint, tmp_path):
    """The k_eq_v checkpoint under a config.json saying attention_k_eq_v false: the full layers would need a v_proj
    the checkpoint lacks; the engine refuses naming the tensor (transformers would initialize it at random)."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    ckpt = tiny_checkpoint(ARCH, overrides=K_EQ_V)

    def off(cfg):
        cfg["attention_k_eq_v"] = False

    with pytest.raises(Exception, match=r"v_proj"):
        LLM(model=str(edit_config(ckpt, tmp_path / "off", off)), device="cpu", dtype="float32")


@pytest.mark.slow
@pytest.mark.engine
def test_layer_scalar_matters(tiny_checkpoint, tmp_path):
    """Every layer_scalar set to 1: transformers' tokens change, the engine follows (the scalar is read and used)."""
    ckpt = tiny_checkpoint(ARCH)

    def ones(t):
        hit = sorted(k for k in t if k.endswith(".layer_scalar"))
        assert len(hit) == 3 and all(float(t[k]) != 1.0 for k in hit)
        for k in hit:
            t[k] = torch.ones_like(t[k])

    _check(ckpt, _edit_tensors(ckpt, tmp_path / "scalar", ones), 4, "layer_scalar = 1")


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("tensor", ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"])
def test_per_layer_input_matters(tensor, tiny_checkpoint, tmp_path):
    """Each half of the per-layer input (the second embedding table, the projection of the embedding) negated:
    transformers' tokens change and the engine follows."""
    ckpt = tiny_checkpoint(ARCH)

    def negate(t):
        t[tensor] = -t[tensor]

    _check(ckpt, _edit_tensors(ckpt, tmp_path / "ple", negate), 5, f"{tensor} negated")


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("what", ["v_norm", "values_from_keys"])
def test_engine_without_the_feature_leaves_transformers(what, tiny_checkpoint, monkeypatch):
    """The engine with v_norm made the identity, or with the full layers' values taken from a zero projection
    instead of the keys: its tokens (or log-probabilities) leave transformers' (the features are what makes it agree)."""
    from test_scalings import _engine, _hf

    ckpt = tiny_checkpoint(ARCH, overrides=K_EQ_V)
    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    orig = mod.Gemma4Attention.forward

    def no_v_norm(self, *args, **kwargs):
        self.v_norm = torch.nn.Identity()
        return orig(self, *args, **kwargs)

    def zero_values(self, positions, hidden_states, residual, norm):
        if self.values_from_keys:                         # v = 0 instead of k: the values' rows, zeroed
            qkv, residual = mod.L.norm_linear(norm, self.qkv_proj, hidden_states, residual)
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = torch.zeros_like(k)
            q, k = mod.L.qk_norm_rope(positions, q, k, self.q_norm, self.k_norm, self.rotary_emb)
            return self.o_proj(self.attn(q, k, v)), residual
        return orig(self, positions, hidden_states, residual, norm)

    monkeypatch.setattr(mod.Gemma4Attention, "forward", no_v_norm if what == "v_norm" else zero_values)
    prompt = np.random.default_rng(7).integers(0, 400, 12).tolist()
    got, want = _engine(ckpt, prompt), _hf(ckpt, prompt)
    assert got[0] != want[0] or not np.allclose(got[1], want[1], atol=1e-3), f"the engine without {what} agrees"


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(num_kv_shared_layers=3), "kv_owners_missing"),
    (lambda c: c.update(enable_moe_block=True), "moe_sizes_given"),     # the MoE without its sizes
    (lambda c: c.update(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (lambda c: c.update(layer_types=["full_attention", "full_attention", "sliding_attention"]), "last_layer_type_ok"),
    (lambda c: c["per_layer_config"]["2"].update(head_dim=64), "per_layer_config"),
])
def test_guard_refuses(edit, field, tiny_checkpoint):
    """What the spec does not model is refused by the config guard, naming the field."""
    import json

    from xllm_gen.runtime.loading.hf_config import ConfigError

    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    cfg = json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())
    mod.Config.from_hf(cfg)
    edit(cfg)
    with pytest.raises(ConfigError, match=field):
        mod.Config.from_hf(cfg)


# KV sharing: 5 layers (full, sliding, sliding, sliding, full), the last 2 read the caches of layers 2 (sliding) and
# 0 (full); the KV-shared layers' MLPs double-wide
KV_SHARED = {"num_hidden_layers": 5, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
             "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                             "full_attention"],
             }


def _kv_shared(tiny_checkpoint):
    from fixtures.tiny_hf import DROP

    over = dict(KV_SHARED, per_layer_config={"2": DROP, "0": {"head_dim": 32}, "4": {"head_dim": 32}})
    return tiny_checkpoint(ARCH, overrides=over)


def _engine_batch(ckpt, prompts, **kw):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.engine
def test_kv_sharing(tiny_checkpoint):
    """num_kv_shared_layers 2: layers 3 and 4 have q alone and attend over the caches of layers 2 and 0 (no cache of
    their own); a batch of prompts with chunked prefill (16-token steps) and prefix caching (a shared prefix, served
    twice) gives transformers' greedy tokens."""
    from hf_ref import hf_greedy_logprobs

    ckpt = _kv_shared(tiny_checkpoint)
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 400, 9).tolist()
    prompts = [prefix + rng.integers(0, 400, n).tolist() for n in (3, 14, 25)] + [prefix + [5, 6]]
    want = [hf_greedy_logprobs(ckpt, p, 8)[0] for p in prompts]
    assert _engine_batch(ckpt, prompts, max_num_batched_tokens=16, enable_prefix_caching=True) == want
    assert _engine_batch(ckpt, prompts[:1] * 2, enable_prefix_caching=True) == want[:1] * 2


@pytest.mark.slow
@pytest.mark.engine
def test_kv_sharing_reads_the_right_layer(tiny_checkpoint, monkeypatch):
    """Layer 3 made to read layer 1's cache (also sliding, same shape) instead of layer 2's: the engine's tokens leave
    transformers' (the source layer matters, so parity above is not luck)."""
    from test_scalings import _engine, _hf

    ckpt = _kv_shared(tiny_checkpoint)
    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    orig = mod.Gemma4Attention.__init__

    def init(self, config, layer_idx):
        orig(self, config, layer_idx)
        if layer_idx == 3:
            assert self.kv_source == 2
            self.kv_source = 1

    monkeypatch.setattr(mod.Gemma4Attention, "__init__", init)
    prompt = np.random.default_rng(8).integers(0, 400, 12).tolist()
    got, want = _engine(ckpt, prompt), _hf(ckpt, prompt)
    assert got[0] != want[0] or not np.allclose(got[1], want[1], atol=1e-3), "layer 3 reading layer 1 agrees"


def test_kv_sharing_refused_on_cuda():
    """The CUDA path refuses KV sharing at load, naming it (runtime/attention/base.py; model_runner calls it when a
    layer reads another's cache)."""
    from xllm_gen.runtime.attention.base import cuda_attention_refusal

    assert "shares KV caches across layers" in cuda_attention_refusal((), shared_kv=True)


def test_gemma_4_31b_text_config_is_read():
    """gemma-4-31B-it's text_config (as transformers 5.7 prints it; the published checkpoint is the multimodal
    Gemma4ForConditionalGeneration, its decoder under model.language_model): accepted, the full layers at
    global_head_dim 512 with num_global_key_value_heads 4 and values from the keys, no per-layer inputs."""
    import torch as _t

    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 10
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2, "dtype": "bfloat16",
        "enable_moe_block": False, "eos_token_id": 1, "expert_intermediate_size": None,
        "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 5376, "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02, "intermediate_size": 21504, "layer_types": types, "max_position_embeddings": 262144,
        "moe_intermediate_size": None, "num_attention_heads": 32, "num_experts": None, "num_global_key_value_heads": 4,
        "num_hidden_layers": 60, "num_key_value_heads": 16, "num_kv_shared_layers": 0, "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": None,
        "use_bidirectional_attention": "vision", "use_cache": True, "use_double_wide_mlp": False,
        "vocab_size": 262144, "vocab_size_per_layer_input": 262144}
    c = mod.Config.from_hf(cfg)
    assert (c.global_head_dim, c.full_kv_heads, c.head_dim, c.num_key_value_heads) == (512, 4, 256, 16)
    assert c.kv_source_of == tuple(range(60)) and c.hidden_size_per_layer_input == 0
    with _t.device("meta"):
        full, sliding = mod.Gemma4Attention(c, 5), mod.Gemma4Attention(c, 0)
    assert full.values_from_keys and tuple(full.qkv_proj.weight.shape) == (32 * 512 + 4 * 512, 5376)
    assert not sliding.values_from_keys and tuple(sliding.qkv_proj.weight.shape) == (32 * 256 + 2 * 16 * 256, 5376)
