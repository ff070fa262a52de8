"""Gemma 4's MoE block beside the dense MLP (enable_moe_block, the 26B-A4B; specs/gemma4.yaml): a parallel step whose
branches are the MLP on the pre-FFN-normed stream and the MoE on the stream itself, each post-normed, the sum
post-normed again; the MoE's router reads its own transform of the stream (a weightless RMSNorm, a learned input scale
times hidden ** -0.5; the `moe` block's `router.input_norm` / `input_weight` / `input_scale`), its routing weights
times a learned per-expert scale (`router.expert_scale`), its experts pre_feedforward_layernorm_2 of the stream
(`expert_norm`). The tiny checkpoint (tests/fixtures/tiny_hf.py; router scales uniform in [0.5, 1.5]) with the MoE on
and the per-layer inputs on (the per-layer step's `when`) agrees with transformers in float32 at TP 1 (and TP 2,
slow); sensitivity arms: the MoE branch zeroed (its down projections), the per-expert scale or the router's input
scale set to 1: transformers' tokens change and the engine follows."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from test_gemma4 import ARCH, _check, _edit_tensors

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24}


def _moe(tiny_checkpoint, **over):
    return tiny_checkpoint(ARCH, overrides={**MOE, **over})


@pytest.mark.engine
@pytest.mark.parametrize("ple", [8, 0], ids=["per_layer_input", "no_per_layer_input"])
def test_moe_parity(ple, tiny_checkpoint):
    """The MoE layers at TP 1, with and without the per-layer inputs: greedy tokens and log-probabilities as
    transformers' in float32."""
    from safetensors import safe_open
    from test_scalings import _agree, _engine, _hf

    ckpt = _moe(tiny_checkpoint, hidden_size_per_layer_input=ple)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.router.proj.weight", "model.layers.0.router.per_expert_scale",
            "model.layers.2.experts.gate_up_proj", "model.layers.1.pre_feedforward_layernorm_2.weight",
            "model.layers.1.post_feedforward_layernorm_1.weight"} <= names
    assert any("per_layer_input_gate" in n for n in names) == (ple > 0)
    prompt = np.random.default_rng(21).integers(0, 400, 13).tolist()
    _agree(_engine(ckpt, prompt), _hf(ckpt, prompt), f"gemma4 MoE (per-layer input {ple})")


@pytest.mark.slow
@pytest.mark.engine
def test_moe_parity_tp2(tiny_checkpoint):
    """TP 2 on CPU (gloo): the experts split over intermediate rows, the router and its scales replicated."""
    from hf_ref import hf_greedy_logprobs
    from test_gemma4 import _engine_batch

    ckpt = _moe(tiny_checkpoint)
    prompt = np.random.default_rng(22).integers(0, 400, 11).tolist()
    want, _ = hf_greedy_logprobs(ckpt, prompt, 8)
    assert _engine_batch(ckpt, [prompt], tensor_parallel_size=2) == [want]


@pytest.mark.engine
@pytest.mark.parametrize("what", ["moe_zeroed", "expert_scale_one", "router_scale_one"])
def test_moe_sensitivity(what, tiny_checkpoint, tmp_path):
    """The MoE branch zeroed (every expert's down projection 0: the branch adds post_feedforward_layernorm_2(0) = 0),
    the per-expert scales or the router's input scale set to 1: transformers' tokens (or log-probabilities) change
    and the engine follows."""
    ckpt = _moe(tiny_checkpoint)

    def edit(t):
        if what == "moe_zeroed":
            keys = [k for k in t if k.endswith("experts.down_proj")]
            fill = torch.zeros_like
        else:
            keys = [k for k in t if k.endswith("router.per_expert_scale" if what == "expert_scale_one"
                                               else "router.scale")]
            fill = torch.ones_like
        assert len(keys) == 3
        for k in keys:
            t[k] = fill(t[k])

    _check(ckpt, _edit_tensors(ckpt, tmp_path / what, edit), 23, what)


def test_moe_guard_and_shapes(tiny_checkpoint):
    """enable_moe_block without its sizes is refused by name; with them the MoE layer class is built (router,
    scales, stacked experts at the config's sizes) and a dense checkpoint builds no MoE module."""
    import json

    from xllm_gen.runtime.loading.hf_config import ConfigError

    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    cfg = json.loads((_moe(tiny_checkpoint) / "config.json").read_text())
    c = mod.Config.from_hf(cfg)
    with torch.device("meta"):
        layer = mod.Gemma4Model(c).layers[0]
    assert isinstance(layer, mod.Gemma4MoEDecoderLayer)
    assert tuple(layer.moe.experts.gate_up_proj.shape) == (4, 48, 64) and tuple(layer.moe.expert_scale.shape) == (4,)
    assert tuple(layer.moe.router_input.weight.shape) == (64,)
    with pytest.raises(ConfigError, match="moe_sizes_given"):
        mod.Config.from_hf({**cfg, "num_experts": None})
    dense = mod.Config.from_hf({**cfg, "enable_moe_block": False})
    with torch.device("meta"):
        layer = mod.Gemma4Model(dense).layers[0]
    assert type(layer) is mod.Gemma4DecoderLayer and not hasattr(layer, "moe")
