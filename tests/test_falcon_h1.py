"""Falcon-H1 (specs/falcon_h1.yaml): attention and a Mamba-2 mixer in parallel in every layer, with muP multipliers,
and the general primitives it is written with:

- a parallel step whose branches are any blocks (a recurrent mixer beside attention), each with an input multiplier
  (`input_scale`) and an output multiplier (`scale`);
- per-segment output multipliers on a fused projection (`qkv.scale: {k: ...}`, `gate_up.scale: {gate: ...}`,
  mamba2 `in_proj: {scale: {z, x, B, C, dt}}`) and an output multiplier on a plain one (`down.scale`);
- the mamba2 block's optional gated norm (`gated_norm`), normalized before or after the gate (`norm_before_gate`),
  and an output projection bias of its own (`out: {bias: ...}`).

Checked here: greedy parity with transformers float32 for the norm-after-gate form (the spec battery runs the
default form, no norm; the conformance battery every multiplier != 1 with the norm before the gate), with chunked
prefill over concurrent sequences; the state carries; every multiplier reaches the computation (sensitivity arms:
one multiplier back to 1, or one in_proj segment's, changes the tokens); the guard refuses by name what the spec does
not model; the compiler refuses misplaced multipliers. TP 2 parity is the battery's slow arm.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "falcon_h1.yaml"
ARCH = "FalconH1ForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12, 40, 41, 42, 43, 44, 45, 46, 47], [7, 8, 9]]
MAX_TOKENS = 8
# every multiplier away from 1 (each segment of ssm_multipliers its own), the mixer's norm after the gate, biases on
ON = {"ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 0.6], "mlp_multipliers": [0.6, 1.4], "key_multiplier": 0.5,
      "attention_in_multiplier": 0.7, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.3,
      "ssm_out_multiplier": 0.6, "embedding_multiplier": 3.0, "lm_head_multiplier": 0.5, "mamba_rms_norm": True,
      "mamba_norm_before_gate": False, "attention_bias": True, "mlp_bias": True, "projectors_bias": True,
      "mamba_proj_bias": True}


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = getattr(transformers, ARCH).from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine(ckpt, prompts=PROMPTS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS))   # stops at EOS, as generate() does
    return [o.outputs[0].token_ids for o in outs]


def _with_config(ckpt, tmp_path, name, **changes) -> Path:
    """A copy of the checkpoint with config.json fields changed (same weights)."""
    out = tmp_path / name
    shutil.copytree(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def on_ckpt(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_checkpoint
    return make_tiny_checkpoint(ARCH, tmp_path_factory.mktemp("falcon_h1_on"), overrides=ON)


@pytest.fixture(scope="module")
def on_tokens(on_ckpt):
    return _hf(on_ckpt)


@pytest.mark.slow
def test_parity_chunked_prefill_and_state(on_ckpt, on_tokens):
    """Every multiplier != 1, the gated norm after the gate: transformers' tokens, prompts prefilled in chunks of 5
    beside each other; zeroing the SSM state before each decode step changes them (the Mamba branch is live)."""
    assert _engine(on_ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2) == on_tokens
    assert _engine(on_ckpt, _debug={"zero_state_at_decode": ("ssm",)}) != on_tokens


# one multiplier back to 1 (the primitive it exercises): the engine's tokens must move off the original ones
SENSITIVITY = {
    "ssm_in_multiplier": 1.0,                                   # input_scale of the Mamba branch
    "attention_in_multiplier": 1.0,                             # input_scale of the attention branch
    "ssm_out_multiplier": 1.0,                                  # a parallel branch's output scale
    "key_multiplier": 1.0,                                      # qkv.scale: {k: ...}
    "mlp_multipliers": [0.6, 1.0],                              # down.scale
    "mamba_norm_before_gate": True,                             # the gated norm's order
}
SEGMENTS = ["z", "x", "B", "C", "dt"]


def test_key_multiplier_matters(on_ckpt, tmp_path):
    """The default arm (no transformers run: the batteries compare the features-ON checkpoint with it): k's segment
    multiplier back to 1 changes the engine's tokens."""
    changed = _with_config(on_ckpt, tmp_path, "key", key_multiplier=1.0)
    assert _engine(changed) != _engine(on_ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(SENSITIVITY))
def test_multiplier_matters(on_ckpt, on_tokens, tmp_path, field):
    changed = _with_config(on_ckpt, tmp_path, field, **{field: SENSITIVITY[field]})
    got = _engine(changed)
    assert got != on_tokens, f"{field}={SENSITIVITY[field]!r} did not change the tokens"
    assert got == _hf(changed), f"{field}={SENSITIVITY[field]!r}: the engine no longer agrees with transformers"


@pytest.mark.slow
@pytest.mark.parametrize("segment", SEGMENTS)
def test_each_in_proj_segment_multiplier_matters(on_ckpt, on_tokens, tmp_path, segment):
    """Each in_proj segment's multiplier reaches its own segment (a mapping that swapped two would still change the
    tokens, but then parity with transformers fails: checked on the changed checkpoint too)."""
    mult = list(ON["ssm_multipliers"])
    # back to 1; x from 1.5 to 1 leaves the tiny model's tokens as they are (transformers' too): x goes to 0.25
    mult[SEGMENTS.index(segment)] = 0.25 if segment == "x" else 1.0
    changed = _with_config(on_ckpt, tmp_path, segment, ssm_multipliers=mult)
    got = _engine(changed)
    assert got != on_tokens and got == _hf(changed)


def _config(**changes):
    import importlib

    from fixtures.tiny_hf import tiny_config
    cfg = tiny_config(ARCH, overrides=ON).to_dict()
    cfg.update(changes)
    return importlib.import_module("xllm_gen.generated.falcon_h1.model").Config.from_hf(cfg)


@pytest.mark.parametrize("changes, field", [
    ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0]}, "ssm_multipliers_count"),
    ({"mlp_multipliers": [1.0, 1.0, 1.0]}, "mlp_multipliers_count"),
    ({"mamba_d_head": 8}, "mamba_heads_fill_d_ssm"),            # mamba_d_head * mamba_n_heads != mamba_d_ssm
    ({"mamba_d_head": "auto"}, "mamba_d_head"),                 # a raw "auto" (save_pretrained writes the int)
    ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"),
    ({"mamba_use_mlp": False}, "mamba_use_mlp"),
    # null: transformers keeps None and fails (k * None); the reader refuses it naming the field (its absence is 1.0)
    ({"key_multiplier": None}, "field 'key_multiplier' is null"),
])
def test_guard(changes, field):
    with pytest.raises(ValueError, match=field):
        _config(**changes)


def test_defaults_follow_transformers():
    """An empty Falcon-H1 config.json (sizes aside) reads transformers' defaults: mamba_d_ssm 1024, the head width
    from it, kv heads 8, every multiplier 1, no mixer norm."""
    from transformers import FalconH1Config
    hf = FalconH1Config()
    cfg = _config()
    assert cfg.mamba_norm_before_gate is False                 # ON overrides it
    import importlib
    full = importlib.import_module("xllm_gen.generated.falcon_h1.model").Config.from_hf(
        {"architectures": [ARCH], "model_type": "falcon_h1"})
    assert (full.mamba_inner, full.mamba_d_head, full.num_key_value_heads) == (
        hf.mamba_d_ssm, hf.mamba_d_head, hf.num_key_value_heads)
    assert tuple(full.ssm_multipliers) == tuple(hf.ssm_multipliers)
    assert tuple(full.mlp_multipliers) == tuple(hf.mlp_multipliers)
    assert full.mamba_rms_norm is hf.mamba_rms_norm and full.mamba_norm_before_gate is hf.mamba_norm_before_gate


# ---- the compiler: misplaced multipliers are errors at their key -------------------------------------------------
BAD = {
    "unknown_segment": ("scale: {k: key_multiplier}", "scale: {kk: key_multiplier}",
                        "qkv.scale.kk: no segment 'kk' (the projection's segments: q, k, v)"),
    "in_proj_scalar": ('          scale: {z: "ssm_multipliers[0]", x: "ssm_multipliers[1]", B: "ssm_multipliers[2]", '
                       'C: "ssm_multipliers[3]",\n                  dt: "ssm_multipliers[4]"}', "          scale: 2.0",
                       "in_proj.scale: per segment"),
    "input_scale_without_norm": ("      - {norm: pre_ff_layernorm, block: feed_forward}",
                                 "      - {block: feed_forward, input_scale: 2.0, post_norm: pre_ff_layernorm}",
                                 "input_scale: scales the normed input of a step with a `norm`"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_compile_errors(case, tmp_path, capsys):
    from xllm_gen.codegen import cli
    old, new, message = BAD[case]
    text = SPEC.read_text()
    assert old in text, old
    path = tmp_path / "falcon_h1.yaml"
    path.write_text(text.replace(old, new, 1))
    code = cli.main([str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_scale_refused_where_not_applied(tmp_path, capsys):
    """A block kind whose template does not apply a projection multiplier refuses one (never ignores it)."""
    from xllm_gen.codegen import cli
    text = (REPO / "specs" / "qwen3_next.yaml").read_text()
    assert text.count("        out: {name: out_proj}\n") == 1
    path = tmp_path / "qwen3_next.yaml"
    path.write_text(text.replace("        out: {name: out_proj}\n", "        out: {name: out_proj, scale: 2.0}\n", 1))
    code = cli.main([str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "output multipliers are not supported on this block kind's projections" in err, err
