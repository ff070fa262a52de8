"""HY-V4 (HYV4ForCausalLM, specs/hy_v4.yaml) against transformers 5.25 (float32, CPU, greedy), and its three
primitives alone:

- `mla_attention.sinks`: a learned logit per head in each softmax denominator (the latent form's attention takes
  them as the plain attention's do); strong sinks change transformers' tokens and the engine agrees;
- `indexer.rope_position: last`: the indexer's rotary on the *last* rope dims of each head (`Rotary(position=
  "last")`), checked against transformers' HYV4Indexer rotation (q . k equal); the first dims instead differ;
- `glu_clamped` with `clamp: before_act`: `silu(min(gate, L)) * clamp(up, -L, L)`, exactly HYV4Experts._apply_gate;
  the clamp after the activation differs; a loose limit (100) changes transformers' tokens and the engine agrees
  (`swiglu_limit <= 0`, which HYV4Config documents as "off" while HYV4Experts still clamps with it, is refused);
- the config guard refuses what the spec does not model, by name.
The features-ON conformance arm (TP 1; TP 2 slow) is tests/conformance's (the default suite's parity arm); the
default-checkpoint parity arms here (TP 1, TP 2) are slow.
"""
from __future__ import annotations

import json

import pytest
from test_sparse_indexer import _edit_tensors, _engine, _hf

HY = "HYV4ForCausalLM"


@pytest.mark.slow
@pytest.mark.engine
def test_parity(tiny_checkpoint):
    """The default tiny checkpoint (the default suite's parity arm is the conformance battery's features-ON one)."""
    ckpt = tiny_checkpoint(HY)
    assert _engine(ckpt) == _hf(ckpt)


@pytest.mark.slow
@pytest.mark.engine
def test_parity_tp2(tiny_checkpoint):
    ckpt = tiny_checkpoint(HY)
    assert _engine(ckpt, tp=2) == _hf(ckpt)


@pytest.mark.engine
def test_sinks_matter(tiny_checkpoint, tmp_path):
    """Sinks of +3 (most of each head's probability mass to the sink) against the checkpoint's: transformers'
    tokens change and the engine agrees."""
    import torch
    base = tiny_checkpoint(HY)
    strong = tmp_path / "strong"
    _edit_tensors(base, strong, lambda n, t: torch.full_like(t, 3.0) if n.endswith("learnable_sink_param") else t)
    assert _hf(strong) != _hf(base), "fixture: strong sinks do not change transformers' tokens"
    assert _engine(strong) == _hf(strong)


@pytest.mark.slow
@pytest.mark.engine
def test_swiglu_limit_loose(tiny_checkpoint):
    """swiglu_limit 100 (no value reaches it) against the fixture's tight 0.5: transformers' tokens change, the engine
    agrees."""
    off = tiny_checkpoint(HY, overrides={"swiglu_limit": 100.0})
    assert _hf(off) != _hf(tiny_checkpoint(HY)), "fixture: the SwiGLU clamp does not change transformers' tokens"
    assert _engine(off) == _hf(off)


def test_clamp_before_act_is_hy_v4_experts():
    import torch
    from transformers.models.hy_v4 import modeling_hy_v4 as M
    from transformers.models.hy_v4.configuration_hy_v4 import HYV4Config

    from xllm_gen.runtime.layers.activation import gated_act
    hf = M.HYV4Experts(HYV4Config(hidden_size=8, moe_intermediate_size=4, n_routed_experts=2, swiglu_limit=0.7,
                                  num_hidden_layers=1, vocab_size=32))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 3
    ours = gated_act("glu_clamped", act="silu", limit=0.7, clamp="before_act")
    torch.testing.assert_close(ours(x), hf._apply_gate(x), rtol=0, atol=0)
    after = gated_act("glu_clamped", act="silu", limit=0.7)
    assert not torch.allclose(after(x), hf._apply_gate(x))
    with pytest.raises(ValueError, match="clamp"):
        gated_act("glu_clamped", act="silu", limit=0.7, clamp="middle")


@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_rotary_on_last_dims(layout):
    """Rotary(position="last") turns the last rotary_dim dims (the pass dims first), as HYV4Indexer does: every
    q . k equals transformers'; the first dims turned instead give other dot products."""
    import torch
    from transformers.models.hy_v4 import modeling_hy_v4 as M

    from xllm_gen.runtime.layers.rotary import Rotary
    g = torch.Generator().manual_seed(0)
    n, heads, hd, rd = 6, 2, 16, 8
    q, k = torch.randn(n, heads, hd, generator=g), torch.randn(n, 1, hd, generator=g)
    pos = torch.arange(3, 3 + n)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = pos[:, None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    qp, qr = q[None].split([hd - rd, rd], -1)
    kp, kr = k[None].split([hd - rd, rd], -1)
    if layout == "interleaved":
        qr, kr = M.apply_rotary_pos_emb_interleave(qr, kr, cos, sin, unsqueeze_dim=2)
    else:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        qr, kr = apply_rotary_pos_emb(qr, kr, cos, sin, unsqueeze_dim=2)
    want = torch.einsum("nhd,md->nhm", torch.cat((qp, qr), -1)[0], torch.cat((kp, kr), -1)[0, :, 0])
    last = Rotary(hd, 10000.0, 64, rotary_dim=rd, layout=layout, position="last")
    q2, k2 = last(pos, q.clone(), k.clone())
    torch.testing.assert_close(torch.einsum("nhd,md->nhm", q2, k2[:, 0]), want)
    first = Rotary(hd, 10000.0, 64, rotary_dim=rd, layout=layout)
    q3, k3 = first(pos, q.clone(), k.clone())
    assert not torch.allclose(torch.einsum("nhd,md->nhm", q3, k3[:, 0]), want, atol=1e-3)


@pytest.mark.parametrize("edit, field", [
    ({"indexer_types": ["shared", "full", "full"]}, "first_layer_shares"),
    ({"indexer_types": ["full", "sparse", "full"]}, "unknown_indexer_types"),
    ({"layer_types": ["indexed_attention", "sliding_attention", "indexed_attention"]}, "non_indexed_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
])
def test_unmodeled_configs_refused_by_name(edit, field, tiny_checkpoint):
    from xllm_gen.runtime.loading.hf_config import ConfigError
    cfg = {**json.loads((tiny_checkpoint(HY) / "config.json").read_text()), **edit}
    module = __import__("xllm_gen.generated.hy_v4.model", fromlist=["Config"])
    with pytest.raises(ConfigError, match=field):
        module.Config.from_hf(cfg)


def _compile_child(tmp_path, blocks: str):
    """A child of specs/hy_v4.yaml with `blocks` merged into its layer blocks: (IR, None) or (None, the error)."""
    from pathlib import Path

    from codegen.errors import SpecError, SpecErrors
    from codegen.loader import load_spec
    from codegen.resolver import resolve
    specs = Path(__file__).resolve().parents[1] / "specs"
    p = tmp_path / "child.yaml"
    p.write_text(f"extends: {specs / 'hy_v4.yaml'}\nname: hy_child\nclass_prefix: HyChild\n"
                 f"architectures: [HyChildForCausalLM]\ndecoder:\n  layers:\n    blocks:\n{blocks}")
    try:
        return resolve(load_spec(p)), None
    except (SpecError, SpecErrors) as e:
        return None, str(e)


def test_compile_errors_name_the_key(tmp_path):
    """`clamp` belongs to glu_clamped only; rope_position takes first | last; sinks is a bool."""
    _, err = _compile_child(tmp_path, "      moe:\n        activation: {kind: swiglu_clamped, alpha: 1.702, limit: 7.0, "
                                      "clamp: before_act}\n")
    assert err and "clamp" in err and "swiglu_clamped" in err
    _, err = _compile_child(tmp_path, "      self_attn:\n        indexer: {rope_position: middle}\n")
    assert err and "rope_position" in err
    _, err = _compile_child(tmp_path, "      self_attn:\n        sinks: maybe\n")
    assert err and "sinks" in err
    ir, err = _compile_child(tmp_path, "      self_attn:\n        indexer: {rope_position: first}\n")
    assert err is None
