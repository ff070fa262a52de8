"""Per-layer choice among several blocks (`block: {select, cases, name}`) and what NemotronH / LFM2-MoE added with it:

- NemotronH (specs/nemotron_h.yaml) on its tiny checkpoint (tests/fixtures/tiny_hf.py: a Mamba-2, MoE, attention,
  MLP, Mamba-2, MoE layer): the runner counts one attention layer for the KV cache and two state layers for the
  state pool (layers without a mixer get neither); a config.json with the older `hybrid_override_pattern` string
  (M * - E) instead of `layers_block_type` is served as transformers serves it (verify: tokens and every layer);
- sensitivity arms: a spec whose letter mapping swaps M and * (or whose cases swap mlp and moe) is refused at load,
  never served; a layer type no case names is refused, naming the value and the expression; the Mamba-2 dt clamp
  is transformers 5.25's `time_step_limit` (the no-op default; another limit is refused by name; time_step_min, which
  5.17 clamped at, is initialization only: raised, transformers' tokens and the engine's stay equal, slow);
- the runtime primitives against transformers' own modules: plain (non-gated) experts (`expert_mlp: plain`) equal
  NemotronHExperts, and LFM2-MoE's router (sigmoid + expert bias, renormalized by sum + 1e-6: `renormalize_epsilon`)
  equals Lfm2MoeTopKRouter exactly, where the `moe` kind's default (+ 1e-20) does not.
Greedy parity at TP 1 (and TP 2 with --runslow) and the features-ON configs are the spec / conformance batteries'.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "nemotron_h.yaml"
ARCH = "NemotronHForCausalLM"
TYPES = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]   # tiny_hf's ARCH_DEFAULTS


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH)


def _pattern_checkpoint(ckpt, tmp_path) -> Path:
    """The tiny checkpoint with config.json as older Hub checkpoints store it: hybrid_override_pattern, no list."""
    out = tmp_path / "pattern"
    shutil.copytree(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    letter = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    cfg["hybrid_override_pattern"] = "".join(letter[t] for t in cfg.pop("layers_block_type"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_layer_accounting(ckpt):
    """One KV-cache layer (the attention layer), two state-pool layers (the Mamba-2 layers); the MLP / MoE layers
    hold neither; the KV bytes per block count the attention layer only."""
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime import layers as L
    with LLM(str(ckpt), device="cpu", dtype="float32") as llm:
        runner = llm.engine.runner
        mixers = [layer.mixer for layer in runner.model.model.layers]
        assert [type(m).__name__ for m in mixers] == ["NemotronHMamba2", "NemotronHSparseMoeBlock",
                                                       "NemotronHAttention", "NemotronHMLP", "NemotronHMamba2",
                                                       "NemotronHSparseMoeBlock"]
        assert [layer.mixer_takes_positions for layer in runner.model.model.layers] == \
            [True, False, True, False, True, False]
        assert len(runner.attn_layers) == 1 and runner.attn_layers[0] is mixers[2].attn
        assert runner.state_layers == [mixers[0], mixers[4]]
        assert all(isinstance(m, L.RecurrentMixer) == (t == "linear_attention") for m, t in zip(mixers, TYPES))
        a = runner.attn_layers[0]
        assert runner._kv_bytes_per_block() == 2 * 1 * runner.block_size * a.num_kv_heads * a.head_dim * 4
        assert mixers[0].time_step_limit == (0.0, float("inf"))       # transformers 5.25's time_step_limit
        out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 250, 8]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_hybrid_override_pattern_config(ckpt, tmp_path):
    """A config.json with the pattern string: transformers converts it (M * - E); the spec's default_expr does the
    same: tokens and every layer agree."""
    from codegen.verify import verify
    report = verify(SPEC, _pattern_checkpoint(ckpt, tmp_path), max_tokens=6, prompt_lens=(5, 17))
    assert report.ok, report.text()


def _mutant(tmp_path, old: str, new: str) -> Path:
    text = SPEC.read_text()
    assert old in text
    path = tmp_path / "nemotron_h_mutant.yaml"
    path.write_text(text.replace(old, new))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    return path


@pytest.mark.parametrize("old, new", [
    # the pattern letters M and * swapped
    ("'linear_attention' if hybrid_override_pattern[i] == 'M' else 'full_attention' if hybrid_override_pattern[i]\n"
     "      == '*'",
     "'full_attention' if hybrid_override_pattern[i] == 'M' else 'linear_attention' if hybrid_override_pattern[i]\n"
     "      == '*'"),
    # the cases mlp and moe swapped
    ("mlp: mlp, moe: moe}", "mlp: moe, moe: mlp}"),
], ids=["letters", "cases"])
def test_wrong_mapping_is_refused(ckpt, tmp_path, old, new):
    """A wrong block mapping builds other modules than the checkpoint's tensors: refused at load, not served."""
    from codegen.verify import verify
    report = verify(_mutant(tmp_path, old, new), _pattern_checkpoint(ckpt, tmp_path), max_tokens=2, prompt_lens=(5,))
    assert report.refused and "cannot load" in report.refused, report.text()


def test_unknown_layer_type_is_refused(ckpt):
    """A layer type no case names: the model is not built; the error names the value and the expression."""
    from generated.nemotron_h import model as M
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg["layers_block_type"] = ["linear_attention", "attention"]
    config = M.Config.from_hf(cfg)
    with torch.device("meta"), pytest.raises(ValueError, match=r"layer 1: layer_types\[layer\] is 'attention'.*"
                                                                r"linear_attention, full_attention, mlp, moe"):
        M.NemotronHModel(config)


def test_plain_experts_equal_transformers():
    """FusedMoE(gated=False): down(act(up)) per expert, as transformers' NemotronHExperts (relu2)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    from xllm_gen.runtime.layers.moe import FusedMoE
    torch.manual_seed(0)
    cfg = NemotronHConfig(hidden_size=16, n_routed_experts=4, moe_intermediate_size=8, mlp_hidden_act="relu2")
    hf = NemotronHExperts(cfg)
    torch.nn.init.normal_(hf.up_proj)
    torch.nn.init.normal_(hf.down_proj)
    ours = FusedMoE(4, 16, 8, 2, renormalize=True, activation="relu2", scoring="sigmoid", gated=False)
    ours.up_proj.data.copy_(hf.up_proj.data)
    ours.down_proj.data.copy_(hf.down_proj.data)
    x = torch.randn(7, 16)
    logits = torch.randn(7, 4)
    from xllm_gen.runtime.ops import moe as moe_ops
    w, ids = moe_ops.select_experts(logits, 2, True, "sigmoid")
    want = hf(x, ids, w)
    torch.testing.assert_close(ours(x, logits), want, rtol=1e-5, atol=1e-5)
    gated = FusedMoE(4, 16, 4, 2, renormalize=True, activation="relu2", scoring="sigmoid")   # act(gate) * up
    gated.gate_up_proj.data.copy_(hf.up_proj.data)
    gated.down_proj.data.copy_(hf.down_proj.data[..., :4])
    assert not torch.allclose(gated(x, logits), want, atol=1e-3)


def test_renormalize_epsilon_equals_lfm2_moe_router():
    """select_experts(renormalize_epsilon=1e-6) is transformers' Lfm2MoeTopKRouter exactly; the default (+ 1e-20
    for sigmoid scores) is not."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    from xllm_gen.runtime.ops import moe as moe_ops
    torch.manual_seed(0)
    cfg = Lfm2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.5)
    router = Lfm2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    bias = torch.randn(8) * 0.1
    x = torch.randn(11, 16)
    _, want_w, want_ids = router(x, bias)
    logits = torch.nn.functional.linear(x, router.weight)
    w, ids = moe_ops.select_experts(logits, 3, True, "sigmoid", score_bias=bias, routed_scale=1.5,
                                    renormalize_epsilon=1e-6)
    order, want_order = ids.sort(-1).indices, want_ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.equal(w.gather(1, order), want_w.gather(1, want_order))
    w20, _ = moe_ops.select_experts(logits, 3, True, "sigmoid", score_bias=bias, routed_scale=1.5)
    assert not torch.equal(w20.gather(1, order), want_w.gather(1, want_order))


@pytest.mark.slow
def test_time_step_min_is_initialization_only(tiny_checkpoint):
    """time_step_min raised to 0.9 (transformers 5.17 clamped dt at it in a prompt; 5.25 reads only time_step_limit):
    the engine matches transformers 5.25 (verify), and a checkpoint whose time_step_limit clamps is refused by name
    (blind NemotronH exercise: the spec had followed 5.17 and served both wrong)."""
    from codegen.verify import verify
    moved = tiny_checkpoint(ARCH, overrides={"time_step_min": 0.9})
    report = verify(SPEC, moved, max_tokens=8, prompt_lens=(9, 30))
    assert report.ok, report.text()
    clamped = tiny_checkpoint(ARCH, overrides={"time_step_limit": [0.5, 1.0]})
    assert not verify(SPEC, clamped, max_tokens=2, prompt_lens=(9,)).ok


@pytest.mark.parametrize("old, new, message", [
    # a variant whose layer list holds a type no case names
    ('hybrid_override_pattern: "M-M-M-M*', 'hybrid_override_pattern: "M-M-M-MX', r"variants\.Nemotron-H-8B-Base-8K: "
     r"the choice's `select` gives 'X' for layer 7, which no case names"),
    # a case naming no block
    ("mlp: mlp, moe: moe}", "mlp: mlp, moe: moes}", r"cases\.moe: no block 'moes'"),
    # one block under two cases
    ("mlp: mlp, moe: moe}", "mlp: mlp, moe: mlp}", r"cases\.moe: block 'mlp' is already another case's"),
], ids=["variant", "unknown-block", "duplicate"])
def test_select_compile_errors(tmp_path, old, new, message):
    """The resolver locates a bad `select` choice: file:line, the case or the variant and the layer."""
    from codegen.compiler import compile_spec
    from codegen.errors import SpecError
    with pytest.raises(SpecError, match=message) as err:
        compile_spec(_mutant(tmp_path, old, new))
    assert "nemotron_h_mutant.yaml:" in str(err.value)
