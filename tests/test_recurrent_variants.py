"""Primitives added for LFM3 / LaraMini / OLMo-Hybrid (issue #20): the `proportional` rope kind against transformers'
own function, and the gated DeltaNet's `beta_scale` (each must change the output when switched). The families'
parity with transformers runs in the spec and conformance batteries (tests/test_spec_battery.py, tests/conformance)."""
from __future__ import annotations

import pytest
import torch

from xllm_gen.runtime.layers.rotary import Rotary, rope_parameters


@pytest.mark.parametrize("prf, factor", [(0.5, None), (0.25, 2.0), (1.0, None), (0.3, None), (0.0, None)])
def test_proportional_rope_matches_transformers(prf, factor):
    from transformers import Lfm3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Lfm3Config(head_dim=16, hidden_size=64, num_attention_heads=4)
    params = dict(cfg.rope_parameters["full_attention"], partial_rotary_factor=prf)
    if factor is not None:
        params["factor"] = factor
    cfg.rope_parameters["full_attention"] = params
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, layer_type="full_attention")
    got, attn = rope_parameters(16, params["rope_theta"], 512, dict(params, rope_type="proportional"))
    assert torch.equal(got, want) and attn == 1.0


def test_proportional_rope_turns_only_its_share():
    """The pairs past the rotating share do not turn (frequency 0); the share's pairs do: switching the share changes q."""
    torch.manual_seed(0)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    pos = torch.arange(5) + 3
    half = Rotary(16, 1e6, 64, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5})
    full = Rotary(16, 1e6, 64, scaling={"rope_type": "proportional", "partial_rotary_factor": 1.0})
    qh, _ = half(pos, q.clone(), k.clone())
    qf, _ = full(pos, q.clone(), k.clone())
    idle = torch.cat((torch.arange(4, 8), torch.arange(12, 16)))        # pairs (j, j + 8) for j = 4..7
    assert torch.equal(qh[..., idle], q[..., idle])
    assert not torch.allclose(qh, q) and not torch.allclose(qh, qf)


def test_proportional_rope_refuses_a_partial_rotary():
    with pytest.raises(ValueError, match="proportional"):
        rope_parameters(8, 1e6, 64, {"rope_type": "proportional", "partial_rotary_factor": 0.5}, full_dim=16)


@pytest.mark.slow
@pytest.mark.engine
def test_gated_delta_net_beta_scale_matters(tiny_checkpoint):
    """OLMo-Hybrid's linear_allow_neg_eigval (beta_scale 2 -> 1): transformers' tokens change and the engine follows."""
    from test_spec_battery import Tokens, _assert_same

    tokens = Tokens()
    on = tiny_checkpoint("OlmoHybridForCausalLM")
    off = tiny_checkpoint("OlmoHybridForCausalLM", overrides={"linear_allow_neg_eigval": False})
    want_on, want_off = tokens.hf(on), tokens.hf(off)
    assert want_on != want_off, "fixture: beta_scale does not change transformers' tokens"
    _assert_same(tokens.engine(off, 1), want_off, "olmo_hybrid linear_allow_neg_eigval=false")
    _assert_same(tokens.engine(on, 1), want_on, "olmo_hybrid linear_allow_neg_eigval=true")
