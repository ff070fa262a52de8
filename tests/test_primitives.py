"""Math primitives for Llama 3, Qwen3 + YaRN, Mistral and Gemma 2, each against transformers' own code (CPU):

- rope scaling: `L.rope_parameters` (inv_freq, attention factor) bit-equal to
  transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS (and the default init) for default / linear / dynamic /
  yarn (Qwen3, DeepSeek mscale forms, explicit attention_factor, truncate off, implied original length) /
  llama3 (the rotary's frequency_bands kind); `L.Rotary(..., scaling=)` and `L.qk_norm_rope` bit-equal to HF's rotary embedding +
  apply_rotary_pos_emb (float32, bfloat16), the float32 table the CUDA kernel reads close to HF's cos/sin,
  mRoPE with scaling vs HF Qwen3-VL; errors name the rope type or key; dynamic beyond max_position documented;
- (1 + w) RMSNorm (`weight_offset=1.0`) bit-equal to Gemma2RMSNorm, plain and fused with the residual add;
- gated activations vs transformers.activations.ACT2FN, `gated_act` names and errors;
- attention with sliding window and logit soft-cap (TorchPagedBackend through L.Attention, block_size 4 so
  windows cross block boundaries) vs HF Gemma 2's eager_attention_forward with masking_utils' sliding-window
  causal mask, for prefill, chunked prefill (queries starting mid-sequence) and decode; arms that must
  differ (window on vs off past the window, soft-cap on vs off) and must not (window >= length);
- Triton kernels (offset norms, gelu_and_mul, q/k norm + rope with a YaRN table) under TRITON_INTERPRET=1
  vs the references (in a subprocess: the variable must be set before triton is imported), and the custom
  ops' opcheck with the new arguments.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from xllm_gen.runtime import layers as L
from xllm_gen.runtime.attention import FULL, AttentionVariant, TorchPagedBackend, attention_variants
from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context


def _init(mod, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return mod


# ================================================================================================ rope scaling
# (name, rope parameters, head_dim, theta, max_position_embeddings)
ROPE_CASES = [
    ("default", {"rope_type": "default"}, 64, 10000.0, 4096),
    ("linear", {"rope_type": "linear", "factor": 4.0}, 64, 10000.0, 4096),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 64, 10000.0, 4096),
    ("dynamic_odd", {"rope_type": "dynamic", "factor": 3.7}, 64, 10000.0, 4096),
    ("yarn_qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6, 131072),
    ("yarn_legacy_type", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6,
     131072),
    ("yarn_mscale", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}, 64, 10000.0, 163840),
    ("yarn_attn_factor", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                          "attention_factor": 0.9, "beta_fast": 16, "beta_slow": 2, "truncate": False},
     64, 10000.0, 4096),
    ("yarn_implied_original", {"rope_type": "yarn", "factor": 2.0}, 64, 10000.0, 4096),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 128, 500000.0, 131072),
    ("llama3_32", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 64, 500000.0, 131072),
]


def _llama_config(params, D, theta, max_position):
    from transformers import LlamaConfig
    params = {k: v for k, v in params.items() if k != "rope_theta"}
    return LlamaConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                       max_position_embeddings=max_position, rope_parameters=dict(params, rope_theta=theta))


def _hf_rope_init(cfg):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")


def _kind(params: dict) -> dict:
    """The mapping as the generated config reader hands it to the rotary: transformers' rope_type name
    translated to the primitive's scaling kind (codegen.resolver.HF_ROPE_TYPES)."""
    from xllm_gen.codegen.resolver import HF_ROPE_TYPES
    name = params.get("rope_type", params.get("type", "default"))
    out = {k: v for k, v in params.items() if k != "type"}
    return dict(out, rope_type=HF_ROPE_TYPES[name])


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_parameters_match_transformers(case):
    _, params, D, theta, max_position = case
    want_inv, want_factor = _hf_rope_init(_llama_config(params, D, theta, max_position))
    inv, factor = L.rope_parameters(D, theta, max_position, _kind(params))
    assert inv.dtype == torch.float32 and inv.shape == (D // 2,)
    assert torch.equal(inv, want_inv)
    assert factor == want_factor
    if params.get("rope_type", params.get("type")) != "default":   # the scaling changes something
        default_inv, _ = L.rope_parameters(D, theta, max_position)
        scaled = not torch.equal(inv, default_inv) or factor != 1.0
        assert scaled == (params.get("rope_type") != "dynamic")    # dynamic: default within max_position


def _hf_rotate(rot_hf, pos, q, k, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    cos, sin = rot_hf(q.to(dtype), pos[None])                       # [1, N, D]
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1), cos[0], sin[0]


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn_qwen3", "yarn_mscale", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_scaled_matches_hf_rotary_embedding(name, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    _, params, D, theta, max_position = next(c for c in ROPE_CASES if c[0] == name)
    cfg = _llama_config(params, D, theta, max_position)
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([p for p in (0, 1, 7, 100, 2047, 8191, 9000, 32767, 40000) if p < max_position]
                       + [max_position - 1])
    N = pos.numel()
    q = torch.randn(N, 4, D, generator=g).to(dtype)
    k = torch.randn(N, 2, D, generator=g).to(dtype)
    qh, kh, cos, sin = _hf_rotate(LlamaRotaryEmbedding(cfg), pos, q, k, dtype)
    rot = L.Rotary(D, theta, max_position, "neox", scaling=_kind(params))
    qo, ko = rot(pos, q, k)
    assert qo.dtype == dtype
    assert torch.equal(qo, qh) and torch.equal(ko, kh)
    # the float32 table the CUDA kernel reads (cos | sin, times the attention factor) agrees with HF's cos/sin
    table = rot.cos_sin_cache[pos]
    if dtype == torch.float32:
        torch.testing.assert_close(table, torch.cat((cos[:, : D // 2], sin[:, : D // 2]), -1), atol=2e-6, rtol=0)
    # the fused q/k-norm + rope path (reference composition on CPU) uses the same scaled cos/sin
    qn, kn = _init(L.RMSNorm(D, 1e-6), 3).to(dtype), _init(L.RMSNorm(D, 1e-6), 4).to(dtype)
    qf, kf = L.qk_norm_rope(pos, q, k, qn, kn, rot)
    qr, kr = rot(pos, qn(q), kn(k))
    assert torch.equal(qf, qr) and torch.equal(kf, kr)
    qh2, kh2, _, _ = _hf_rotate(LlamaRotaryEmbedding(cfg), pos, qn(q), kn(k), dtype)
    assert torch.equal(qf, qh2) and torch.equal(kf, kh2)
    # sensitivity: the unscaled rotary differs wherever the scaling does something
    if params["rope_type"] != "dynamic":
        qd, _ = L.Rotary(D, theta, max_position, "neox")(pos, q, k)
        assert (qd.float() - qo.float()).abs().max() > 1e-2


def test_rotary_mrope_with_scaling_matches_hf_qwen3_vl():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb
    D, theta, section = 32, 5_000_000.0, [6, 5, 5]
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
              "mrope_section": section, "mrope_interleaved": True}
    cfg = Qwen3VLTextConfig(hidden_size=D * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                            max_position_embeddings=4096, rope_parameters=dict(params, rope_theta=theta))
    t = [0, 1, 2, 3] + [4] * 6 + [700, 3000]
    h = [0, 1, 2, 3] + [4, 4, 4, 5, 5, 5] + [700, 3000]
    w = [0, 1, 2, 3] + [4, 5, 6, 4, 5, 6] + [700, 3000]
    pos3 = torch.tensor([t, h, w])
    N = pos3.shape[1]
    q, k = torch.randn(N, 4, D), torch.randn(N, 2, D)
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(q, pos3[:, None, :])
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rot = L.Rotary(D, theta, 4096, "mrope_interleaved", section, scaling=params)
    qo, ko = rot(pos3, q, k)
    assert rot.attention_factor > 1.0
    assert torch.equal(qo, qh[0].transpose(0, 1)) and torch.equal(ko, kh[0].transpose(0, 1))
    # text-only mRoPE with scaling equals neox with the same scaling
    pt = torch.arange(N) * 300
    qn, _ = L.Rotary(D, theta, 4096, "neox", scaling=params)(pt, q, k)
    qm, _ = rot(pt.expand(3, N), q, k)
    assert torch.equal(qn, qm)


def test_rope_dynamic_within_and_beyond_max_position():
    """dynamic: HF's cos/sin within max_position_embeddings are ours; beyond, HF rescales the base for the whole
    call (documented: this runtime keeps the default frequencies, HF's per-call rescale needs re-rotating the
    cached keys)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    _, params, D, theta, max_position = next(c for c in ROPE_CASES if c[0] == "dynamic")
    cfg = _llama_config(params, D, theta, max_position)
    q, k = torch.randn(3, 4, D), torch.randn(3, 2, D)
    rot = L.Rotary(D, theta, max_position, "neox", scaling=_kind(params))
    inside = torch.tensor([0, 1000, max_position - 1])
    qh, kh, _, _ = _hf_rotate(LlamaRotaryEmbedding(cfg), inside, q, k, torch.float32)
    qo, ko = rot(inside, q, k)
    assert torch.equal(qo, qh) and torch.equal(ko, kh)
    beyond = torch.tensor([0, 1000, 2 * max_position])
    qh, _, _, _ = _hf_rotate(LlamaRotaryEmbedding(cfg), beyond, q, k, torch.float32)
    qo, _ = rot(beyond, q, k)
    assert (qo - qh).abs().max() > 1e-3


def test_rope_scaling_errors_name_the_key():
    with pytest.raises(ValueError, match="longrope"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="'factor'"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "yarn", "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="'factor'"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="'high_freq_factor'"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "frequency_bands", "factor": 8.0, "low_freq_factor": 1.0})
    with pytest.raises(ValueError, match="'beta_fastt'"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "yarn", "factor": 2.0, "beta_fastt": 32})
    with pytest.raises(ValueError, match="rope_theta"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="'factor'"):
        L.Rotary(64, 1e4, 128, scaling={"rope_type": "linear", "factor": "2"})
    # default and None are the same rotary; the kind check still comes first
    a = L.Rotary(64, 1e4, 128, scaling={"rope_type": "default", "rope_theta": 1e4})
    b = L.Rotary(64, 1e4, 128)
    assert torch.equal(a.inv_freq, b.inv_freq) and torch.equal(a.cos_sin_cache, b.cos_sin_cache)
    with pytest.raises(ValueError, match="rotary kind"):
        L.Rotary(64, 1e4, 128, "yarn")


# ================================================================================================ (1 + w) RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_weight_offset_matches_gemma2(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    hf = _init(Gemma2RMSNorm(64, eps=1e-6), 5, 0.3).to(dtype)
    ours = L.RMSNorm(64, 1e-6, weight_offset=1.0).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    r = torch.randn(7, 64, generator=g).to(dtype)
    y = ours(x)
    assert y.dtype == dtype and torch.equal(y, hf(x))
    y2, new_r = ours(x, r)                                  # fused residual add + norm
    assert torch.equal(new_r, r + x) and torch.equal(y2, hf(r + x))
    y3, same = ours(x, None)
    assert same is x and torch.equal(y3, hf(x))
    # sensitivity: offset 0 (Llama / Qwen math on the same weight) is a different norm
    plain = L.RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(hf.weight)
    assert (plain(x).float() - y.float()).abs().max() > 0.1
    # the weight_offset=0 default stays HF Qwen3's math
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    q3 = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        q3.weight.copy_(hf.weight)
    assert torch.equal(plain(x), q3(x))


# ================================================================================================ activations
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations_match_act2fn(dtype):
    from transformers.activations import ACT2FN
    x = (torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    gate, up = x[:, :40], x[:, 40:]
    for name in ("silu", "swish", "gelu", "gelu_pytorch_tanh"):
        got = L.gated_act(name)(x)
        assert got.dtype == dtype and torch.equal(got, ACT2FN[name](gate) * up), name
    # gelu_new: HF's tanh formula written out, equal to the tanh GELU up to rounding
    torch.testing.assert_close(L.gated_act("gelu_new")(x), ACT2FN["gelu_new"](gate) * up,
                               atol=1e-5 if dtype == torch.float32 else 5e-2, rtol=1e-5 if dtype == torch.float32 else 2e-2)
    assert isinstance(L.gated_act("silu"), L.SiluAndMul) and isinstance(L.gated_act("swish"), L.SiluAndMul)
    assert L.gated_act("gelu").approximate == "none" and L.gated_act("gelu_pytorch_tanh").approximate == "tanh"
    assert L.GeluAndMul().approximate == "tanh"
    # sensitivity: tanh vs exact GELU differ
    assert not torch.equal(L.GeluAndMul("tanh")(x.float()), L.GeluAndMul("none")(x.float()))
    assert {"silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu2"} <= set(L.GATED_ACTIVATIONS)
    with pytest.raises(ValueError, match="'swiglu'.*silu"):
        L.gated_act("swiglu")
    with pytest.raises(ValueError, match="approximate"):
        L.GeluAndMul("erf")


# ================================================================================================ attention variants
def _make_step(seq_lens, query_lens, block_size, num_blocks, seed=0, pad_rows=0):
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    nblk = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(nblk + [1])
    for n, Q, nb in zip(seq_lens, query_lens, nblk):
        blocks = [free.pop() for _ in range(nb)]
        tables.append(blocks + [-1] * (max_blocks - nb))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n - Q, n)]
    tables += [[-1] * max_blocks] * pad_rows
    slots += [-1] * pad_rows
    seq_lens = list(seq_lens) + [0] * pad_rows
    query_lens = list(query_lens) + [1] * pad_rows
    cu = [0]
    for Q in query_lens:
        cu.append(cu[-1] + Q)
    ctx = ForwardContext(is_prefill=any(Q > 1 for Q in query_lens), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         block_tables=torch.tensor(tables, dtype=torch.int32), block_size=block_size,
                         seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)
    return ctx, tables


def _hf_reference(q, k, v, scale, window, softcap):
    """HF Gemma 2 eager attention of the last Q positions of one sequence: q [Q, H, D], k/v [L, Hk, D]; the mask
    from transformers.masking_utils (sliding-window causal or causal), queries at positions L-Q..L-1."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    Q, H, D = q.shape
    n, Hk, _ = k.shape
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx = torch.arange(n - Q, n)[:, None]
    kv_idx = torch.arange(n)[None, :]
    visible = fn(0, 0, q_idx, kv_idx)
    mask = torch.zeros(Q, n).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]

    class M(torch.nn.Module):
        num_key_value_groups = H // Hk
        head_dim = D
        training = False

    out, _ = eager_attention_forward(M(), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=scale, softcap=softcap)
    return out[0]                                           # [Q, H, D]


ATTN_MODES = {
    "prefill": ([13, 6, 1, 9], [13, 6, 1, 9], 0),
    "chunked": ([13, 11, 6, 4], [5, 3, 6, 2], 0),           # queries start mid-sequence (cached prefix)
    "decode": ([9, 1, 16, 6, 14], [1, 1, 1, 1, 1], 2),       # + 2 padding rows (no KV, slot -1)
}


def _run_attention(mode, window, softcap, H=4, Hk=2, D=16, bs=4, seed=0, cache=True):
    seq_lens, query_lens, pad = ATTN_MODES[mode]
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    ctx, tables = _make_step(seq_lens, query_lens, bs, num_blocks, seed=seed, pad_rows=pad)
    kc = torch.randn(num_blocks, bs, Hk, D, generator=g)   # garbage everywhere...
    vc = torch.randn(num_blocks, bs, Hk, D, generator=g)
    full_k = [torch.randn(n, Hk, D, generator=g) for n in seq_lens]
    full_v = [torch.randn(n, Hk, D, generator=g) for n in seq_lens]
    for i, (n, Q) in enumerate(zip(seq_lens, query_lens)):  # ...and each sequence's cached history in its pages
        for p in range(n - Q):
            kc[tables[i][p // bs], p % bs] = full_k[i][p]
            vc[tables[i][p // bs], p % bs] = full_v[i][p]
    N = sum(query_lens) + pad
    q = torch.randn(N, H, D, generator=g) * 2
    k = torch.cat([fk[n - Q:] for fk, n, Q in zip(full_k, seq_lens, query_lens)] + [torch.randn(pad, Hk, D)])
    v = torch.cat([fv[n - Q:] for fv, n, Q in zip(full_v, seq_lens, query_lens)] + [torch.randn(pad, Hk, D)])
    attn = L.Attention(H, Hk, D, scale=D ** -0.5, sliding_window=window, logit_softcap=softcap)
    if cache:
        attn.k_cache, attn.v_cache = kc, vc
    backend = TorchPagedBackend()
    backend.plan(ctx)
    ctx.backend = backend
    set_context(ctx)
    try:
        out = attn(q, k.reshape(N, -1), v.reshape(N, -1)).view(N, H, D)
    finally:
        reset_context()
    refs = []
    row = 0
    for i, (n, Q) in enumerate(zip(seq_lens, query_lens)):
        refs.append((out[row:row + Q], _hf_reference(q[row:row + Q], full_k[i], full_v[i], D ** -0.5, window, softcap)))
        row += Q
    assert torch.equal(out[row:], torch.zeros(pad, H, D))   # padding rows: zeros
    return out, refs


@pytest.mark.parametrize("mode", list(ATTN_MODES))
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 1.5), (3, 1.5), (1, None)])
def test_attention_window_softcap_vs_hf_eager(mode, window, softcap):
    out, refs = _run_attention(mode, window, softcap)
    for got, want in refs:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_attention_variant_sensitivity():
    """Arms that must differ (and one that must not): the window changes the output once a sequence is longer
    than it, and only on those rows; soft-capping changes it; a window >= every length is plain causal."""
    for mode in ATTN_MODES:
        seq_lens, query_lens, pad = ATTN_MODES[mode]
        base, _ = _run_attention(mode, None, None)
        win, _ = _run_attention(mode, 5, None)
        cap, _ = _run_attention(mode, None, 1.5)
        wide, _ = _run_attention(mode, max(seq_lens), None)
        assert torch.equal(wide, base)
        assert (cap - base).abs().max() > 1e-2
        row = 0
        for n, Q in zip(seq_lens, query_lens):
            for j in range(Q):
                differs = (win[row + j] - base[row + j]).abs().max() > 1e-4
                assert bool(differs) == (n - Q + j >= 5), (mode, n, Q, j)   # position >= window: keys dropped
            row += Q


def test_attention_window_without_kv_cache():
    """The cache-less prefill path (k/v of the step) applies the window and soft-cap too."""
    out, refs = _run_attention("prefill", 3, 1.5, cache=False)
    for got, want in refs:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_attention_variant_arguments():
    a = L.Attention(4, 2, 16, 0.25)
    assert a.variant == FULL and a.variant.window_left == -1
    b = L.Attention(4, 2, 16, 0.25, sliding_window=4096, logit_softcap=50)
    assert b.variant == AttentionVariant(4096, 50.0) and b.variant.window_left == 4095
    assert attention_variants([a, b, L.Attention(4, 2, 16, 0.25), b]) == (FULL, AttentionVariant(4096, 50.0))
    for bad in (0, -1, True, 2.5, "4096"):
        with pytest.raises(ValueError, match="sliding_window"):
            L.Attention(4, 2, 16, 0.25, sliding_window=bad)
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="logit_softcap"):
            L.Attention(4, 2, 16, 0.25, logit_softcap=bad)


# ================================================================================================ Triton kernels
def _kernel_checks():
    from xllm_gen.runtime.ops import reference as R
    from xllm_gen.runtime.ops import triton_kernels as T

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def err(a, b):
        if a.dtype != b.dtype or a.shape != b.shape:
            return float("inf")
        return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())

    tol = {torch.float32: 2e-6, torch.bfloat16: 3e-2}
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        n = str(dt).split(".")[-1]
        t = tol[dt]
        x = rnd(5, 64, dtype=dt, scale=3)[:, :48]              # strided rows, D not a power of 2
        w = rnd(48, dtype=dt, scale=0.3)
        r = rnd(5, 48, dtype=dt)
        for off in (1.0, 0.0):
            out[f"rms_norm_offset{off}_{n}"] = (err(T.rms_norm(x, w, 1e-6, off), R.rms_norm(x, w, 1e-6, off)), t)
            y, nr = T.fused_add_rms_norm(x, r, w, 1e-6, off)
            y2, nr2 = R.fused_add_rms_norm(x, r, w, 1e-6, off)
            out[f"fused_add_rms_norm_offset{off}_{n}"] = (max(err(y, y2), err(nr, nr2)), t)
        # the offset must matter (sensitivity of the kernel's branch)
        out[f"rms_norm_offset_differs_{n}"] = (
            float(err(T.rms_norm(x, w, 1e-6, 1.0), T.rms_norm(x, w, 1e-6, 0.0)) < 0.05), 0.0)
        x3 = rnd(2, 3, 2 * 40, dtype=dt, scale=3)
        for approx in ("tanh", "none"):
            out[f"gelu_and_mul_{approx}_{n}"] = (err(T.gelu_and_mul(x3, approx), R.gelu_and_mul(x3, approx)), t)
        D, H, Hk, N = 32, 4, 2, 7
        qkv = rnd(N, (H + 2 * Hk) * D, dtype=dt)
        q, k, _ = qkv.split([H * D, Hk * D, Hk * D], -1)
        q, k = q.view(N, H, D), k.view(N, Hk, D)
        qw, kw = rnd(D, dtype=dt), rnd(D, dtype=dt)
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        for kind in ("neox", "mrope_interleaved"):
            rot = L.Rotary(D, 1e4, 256, kind, None if kind == "neox" else [6, 5, 5], scaling=yarn)
            pos = torch.randint(0, 256, (N,) if kind == "neox" else (3, N), generator=g)
            for norm in (True, False):
                a = T.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.cos_sin_cache,
                                   rot.axis_map)
                b = R.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.inv_freq,
                                   rot.axis_map, rot.attention_factor)
                out[f"qk_norm_rope_yarn_{kind}_{'norm' if norm else 'nonorm'}_{n}"] = (
                    max(err(a[0], b[0]), err(a[1], b[1])), t)
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print("RESULT " + json.dumps(_kernel_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", ["rms_norm_offset", "fused_add_rms_norm_offset", "gelu_and_mul", "qk_norm_rope_yarn"])
def test_triton_kernels_interpreted_vs_reference(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case)}
    assert got, interpreted.keys()
    for name, (e, tol) in got.items():
        assert e <= tol, f"{name}: error {e} > {tol}"


def test_custom_ops_opcheck_new_arguments():
    from xllm_gen.runtime import ops  # noqa: F401  (registers xllm::*)
    xo = torch.ops.xllm
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    torch.library.opcheck(xo.rms_norm, (x, w, 1e-6, 1.0))
    torch.library.opcheck(xo.rms_norm, (x.bfloat16(), w, 1e-6, 1.0))     # Gemma: output keeps x's dtype
    assert xo.rms_norm(x.bfloat16(), w, 1e-6, 1.0).dtype == torch.bfloat16
    torch.library.opcheck(xo.fused_add_rms_norm, (x, r, w, 1e-6, 1.0))
    torch.library.opcheck(xo.gelu_and_mul, (torch.randn(3, 32), "tanh"))
    torch.library.opcheck(xo.gelu_and_mul, (torch.randn(3, 32), "none"))
    rot = L.Rotary(16, 1e4, 64, scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    pos = torch.randint(0, 64, (3,))
    torch.library.opcheck(xo.qk_norm_rope, (q, k, w, w, 1e-6, pos, rot.inv_freq, rot.cos_sin_cache, None,
                                            rot.attention_factor))
    from xllm_gen.runtime.ops import reference as R
    assert torch.equal(xo.rms_norm(x, w, 1e-6, 1.0), R.rms_norm(x, w, 1e-6, 1.0))
    assert torch.equal(xo.gelu_and_mul(torch.ones(2, 8), "none"), R.gelu_and_mul(torch.ones(2, 8), "none"))
