"""Absolute position embeddings (`decoder.embed_positions`: learned / sinusoidal, with an offset), attention
without rotary, a per-layer attention scale and ALiBi (`attention.alibi`).

- layer level: the sinusoidal table equals transformers' XGLM table; the ALiBi slopes equal Bloom's and MPT's
  (power-of-2 and other head counts), and the backend's ALiBi scores equal transformers' MPT attention math;
- sensitivity arms on the tiny checkpoints of specs/gpt2.yaml and specs/mpt.yaml: each modeled field changes
  transformers' greedy tokens and the engine still agrees (scale_attn_by_inverse_layer_idx, scale_attn_weights,
  clip_qkv, softmax_scale); the position table itself is live (zeroed, transformers' tokens change and the engine
  follows); reorder_and_upcast_attn (precision only) keeps parity;
- the config guard refuses what MPT's transformers class fixes (alibi_bias_max, expansion_ratio) by name;
- CUDA refuses ALiBi by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

STEPS = 10


# ------------------------------------------------------------------------------------------------ layer level
@pytest.mark.parametrize("dim", [16, 17])
def test_sinusoidal_table_matches_xglm(dim):
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    from xllm_gen.runtime import layers as L

    hf = XGLMSinusoidalPositionalEmbedding(40, dim, padding_idx=1)      # rows 40 + offset 2
    pe = L.SinusoidalPositionEmbedding(40, dim, offset=2)
    pos = torch.tensor([0, 1, 5, 39])
    torch.testing.assert_close(pe(pos), hf.weights[pos + 2].float(), atol=0, rtol=0)


def test_learned_positions_with_offset_match_opt():
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    from xllm_gen.runtime import layers as L

    hf = OPTLearnedPositionalEmbedding(30, 8)                            # rows 30 + 2
    torch.nn.init.normal_(hf.weight)
    pe = L.LearnedPositionEmbedding(30, 8, offset=2)
    pe.weight.data.copy_(hf.weight.data)
    want = hf(torch.ones(1, 7, dtype=torch.long), cache_length=3)[0]    # a 4-token step after 3 cached: 3..6
    torch.testing.assert_close(pe(torch.arange(3, 7)), want, atol=0, rtol=0)


@pytest.mark.parametrize("heads", [1, 4, 6, 8, 12, 20])
def test_alibi_slopes_match_bloom_and_mpt(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from xllm_gen.runtime import layers as L

    ours = L.alibi_slopes(heads, 8)
    torch.testing.assert_close(ours, _get_alibi_slopes(heads, "cpu").float(), atol=0, rtol=1e-6)
    mpt = build_mpt_alibi_tensor(heads, 2, alibi_bias_max=8)[:, 0, 0]    # slope * (1 - 2) = -slope
    torch.testing.assert_close(ours, -mpt.float(), atol=0, rtol=1e-6)
    assert not torch.allclose(L.alibi_slopes(heads, 16), ours)      # bias_max is live


def test_alibi_attend_matches_mpt_scores():
    """attend(..., alibi_slopes) = softmax(q k^T * scale + MPT's alibi bias, causal) v, with a query offset (a
    decode / chunked step); and without the slopes the result differs (the bias is live)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.attention.torch_ref import attend

    g = torch.Generator().manual_seed(0)
    H, D, Lk, Q = 4, 8, 9, 3
    q, k, v = torch.randn(Q, H, D, generator=g), torch.randn(Lk, H, D, generator=g), torch.randn(Lk, H, D, generator=g)
    scale = D ** -0.5
    got = attend(q, k, v, scale, Lk - Q, alibi_slopes=L.alibi_slopes(H))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale + build_mpt_alibi_tensor(H, Lk)   # [H, 1, Lk] broadcast
    qpos = torch.arange(Q)[:, None] + Lk - Q
    s = s.masked_fill(torch.arange(Lk)[None, :] > qpos, float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attend(q, k, v, scale, Lk - Q), want, atol=1e-3)


# ------------------------------------------------------------------------------------------------ engine arms
def _engine(ckpt, prompts):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("row", [1, 2, 5, -1])
def test_sinusoidal_zero_row_matches_xglm_padding_idx(row):
    """`zero_row` (decoder.embed_positions): transformers' padding_idx row of the table is zeros, indexed as it indexes
    it; a row outside the table is refused by name."""
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    from xllm_gen.runtime import layers as L
    hf = XGLMSinusoidalPositionalEmbedding(40, 16, padding_idx=row)
    pe = L.SinusoidalPositionEmbedding(40, 16, offset=2, zero_row=row)
    pos = torch.arange(40)
    torch.testing.assert_close(pe(pos), hf.weights[pos + 2].float(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="zero_row 42 is outside"):
        L.SinusoidalPositionEmbedding(40, 16, offset=2, zero_row=42)


@pytest.mark.engine
@pytest.mark.parametrize("pad", [2, 5])
def test_xglm_pad_token_zeroes_a_position(tiny_checkpoint, tmp_path, pad):
    """XGLM with pad_token_id 2 (a fine-tune's pad = eos: position 0 reads zeros) or 5 (position 3): transformers'
    tokens change, the engine follows (specs/xglm.yaml `zero_row: pad_token_id`)."""
    def edit(cfg):
        cfg["pad_token_id"] = pad
    _config_arm(tiny_checkpoint, tmp_path, "XGLMForCausalLM", edit, f"pad_token_id {pad}")


def _prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 400, n).tolist() for n in (5, 23)]


def _check(ckpt, arm, what, must_change=True):
    from hf_ref import hf_greedy

    prompts = _prompts()
    base = hf_greedy(ckpt, prompts, STEPS)
    want = hf_greedy(arm, prompts, STEPS)
    if must_change:
        assert want != base, f"{what} changes nothing in transformers' output on the tiny checkpoint: no arm"
    assert _engine(arm, prompts) == want, f"{what}: engine differs from transformers"


def _config_arm(tiny_checkpoint, tmp_path, arch, edit, what, must_change=True):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(arch)
    _check(ckpt, edit_config(ckpt, tmp_path / "arm", edit), what, must_change)


@pytest.mark.engine
def test_gpt2_inverse_layer_idx_scale(tiny_checkpoint, tmp_path):
    def on(cfg):
        cfg["scale_attn_by_inverse_layer_idx"] = True
    _config_arm(tiny_checkpoint, tmp_path, "GPT2LMHeadModel", on, "scale_attn_by_inverse_layer_idx true")


@pytest.mark.engine
def test_gpt2_unscaled_attention(tiny_checkpoint, tmp_path):
    def off(cfg):
        cfg["scale_attn_weights"] = False
    _config_arm(tiny_checkpoint, tmp_path, "GPT2LMHeadModel", off, "scale_attn_weights false")


@pytest.mark.engine
def test_gpt2_reorder_and_upcast_is_precision_only(tiny_checkpoint, tmp_path):
    def on(cfg):
        cfg["reorder_and_upcast_attn"] = True
    _config_arm(tiny_checkpoint, tmp_path, "GPT2LMHeadModel", on, "reorder_and_upcast_attn true", must_change=False)


@pytest.mark.engine
def test_gpt2_position_table_is_live(tiny_checkpoint, tmp_path):
    """The learned position table zeroed in the checkpoint: transformers' tokens change, the engine follows."""
    from safetensors.torch import load_file, save_file

    ckpt = Path(tiny_checkpoint("GPT2LMHeadModel"))
    arm = tmp_path / "nopos"
    arm.mkdir()
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (arm / f.name).write_bytes(f.read_bytes())
    for f in ckpt.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors = {n: (torch.zeros_like(t) if n.endswith("wpe.weight") else t) for n, t in tensors.items()}
        save_file(tensors, str(arm / f.name), metadata={"format": "pt"})
    _check(ckpt, arm, "zeroed wpe")


@pytest.mark.engine
def test_mpt_clip_qkv_and_softmax_scale(tiny_checkpoint, tmp_path):
    def clip(cfg):
        cfg["attn_config"]["clip_qkv"] = 0.05
    _config_arm(tiny_checkpoint, tmp_path / "clip", "MptForCausalLM", clip, "attn_config.clip_qkv 0.05")

    def scale(cfg):
        cfg["attn_config"]["softmax_scale"] = 2.0
    _config_arm(tiny_checkpoint, tmp_path / "scale", "MptForCausalLM", scale, "attn_config.softmax_scale 2.0")


@pytest.mark.parametrize("field,value", [("attn_config.alibi_bias_max", 16), ("expansion_ratio", 2),
                                         ("attn_config.alibi", False)])
def test_mpt_guard_refuses_what_transformers_fixes(tiny_checkpoint, field, value):
    from xllm_gen.runtime.loading import registry
    from xllm_gen.runtime.loading.hf_config import ConfigError

    cfg = json.loads((Path(tiny_checkpoint("MptForCausalLM")) / "config.json").read_text())
    node = cfg
    *parents, leaf = field.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    module, _ = registry.resolve(cfg)
    with pytest.raises(ConfigError, match=leaf):
        module.Config.from_hf(cfg)


@pytest.mark.parametrize("field,value", [("layer_norm_elementwise_affine", False)])
def test_opt_guard_refuses_the_forms_it_does_not_model(tiny_checkpoint, field, value):
    """LayerNorms without parameters: refused by name. (opt-350m's post-LN layers and project_in / project_out are
    served: tests/test_opt_post_ln.py.)"""
    from xllm_gen.runtime.loading import registry
    from xllm_gen.runtime.loading.hf_config import ConfigError

    cfg = json.loads((Path(tiny_checkpoint("OPTForCausalLM")) / "config.json").read_text())
    cfg[field] = value
    module, _ = registry.resolve(cfg)
    with pytest.raises(ConfigError, match=field):
        module.Config.from_hf(cfg)


def test_alibi_refused_on_cuda_by_name():
    """The CUDA backend choice refuses a model with ALiBi layers, naming ALiBi (no GPU needed)."""
    from types import SimpleNamespace

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    layer = L.Attention(4, 4, 8, 0.35, alibi_slopes=L.alibi_slopes(4))
    fake = SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=[layer])
    with pytest.raises(NotImplementedError, match="ALiBi"):
        ModelRunner._make_backend(fake)


def test_group_layout_reads_codegen_rows():
    """`per: group` with 4 groups of [q v k]: the view presents q | k | v blocked, reading a rank's rows only."""
    from types import SimpleNamespace as NS

    from xllm_gen.runtime.loading.layout import RowLayout

    H, D, G = 8, 2, 4
    # checkpoint rows: group g holds [q (2 heads) | v (2 heads) | k (2 heads)], each head D rows, value = tag
    rows = []
    for g in range(G):
        for seg in "qvk":
            for h in range(H // G):
                rows += [f"{seg}{g * (H // G) + h}"] * D
    tags = sorted(set(rows))
    t = torch.tensor([tags.index(r) for r in rows], dtype=torch.float32)[:, None]
    view = RowLayout("group", ("q", "v", "k"), groups=G).view(t, [NS(name=n, heads=H, unit=D) for n in "qkv"])
    got = [tags[int(x)] for x in view[0:3 * H * D][:, 0]]
    want = [f"{s}{h}" for s in "qkv" for h in range(H) for _ in range(D)]
    assert got == want
    with pytest.raises(ValueError, match="groups"):
        RowLayout("group", ("q", "v", "k"))


def test_per_layer_scale_refused_on_cuda_by_name():
    """Attention layers with different scales (GPT-2's scale_attn_by_inverse_layer_idx): the CUDA backend (one
    sm_scale per plan) refuses at load, naming the per-layer scale; one scale everywhere passes that check."""
    from types import SimpleNamespace

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    layers = [L.Attention(4, 4, 8, 0.35 / (i + 1)) for i in range(3)]
    fake = SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=layers)
    with pytest.raises(NotImplementedError, match="per-layer attention scale"):
        ModelRunner._make_backend(fake)
