"""`xllm-gen draft` and `xllm-gen verify` on a family that has no spec in specs/.

The family is the first of DRAFT_CANDIDATES (Llama-like decoders of transformers) that no spec claims, so the
test keeps meaning "a family with no spec" when someone adds a spec for one of them. Its tiny checkpoint has
the family's own flags ON (q/k/v bias, o_proj bias and MLP bias on separate flags for Seed-OSS), so the draft
must bind each bias to its flag.
  - draft from the checkpoint dir -> a spec that compiles, with the CHECKLIST at the top, every config field
    of the class accounted for (a symbol, config_assume, config_ignore, a generic field or a checklist item);
  - verify drafted spec x checkpoint -> OK (exit 0), every layer's error within the float32 tolerance;
  - verify a deliberately wrong spec -> exit 1 and the first divergence located: a wrong norm eps diverges
    at layer 0, position 0; a sliding window of 4 on the last layer only diverges at that layer, position 4;
  - verify refuses by name what the spec does not model (a window in config.json the draft does not read).
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml
from spec_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]
DRAFT_CANDIDATES = {
    "SeedOssForCausalLM": {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
    "MinistralForCausalLM": {},
}


def _claimed() -> set:
    out = set()
    for p in (ROOT / "specs").glob("*.yaml"):
        out |= set((read_yaml(p) or {}).get("architectures") or ())
    return out


# The first candidate no spec claims; when every one is claimed (specs/seed_oss.yaml, specs/ministral.yaml exist),
# the first one: the draft compiles out of tree and verify serves the drafted module, so the shipped spec plays no
# part in what is tested. (HyperCLOVAX is no candidate: its post-norms, use_post_norm, are not Llama-like.)
ARCH, OVERRIDES = next(((a, o) for a, o in DRAFT_CANDIDATES.items() if a not in _claimed()),
                       next(iter(DRAFT_CANDIDATES.items())))


def _cli(*args) -> tuple[int, str, str]:
    from xllm_gen.codegen.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH, overrides=OVERRIDES)


@pytest.fixture(scope="module")
def drafted(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "specs" / "drafted.yaml"
    rc, stdout, stderr = _cli("draft", str(ckpt), "-o", str(out))
    assert rc == 0, stderr
    assert out.is_file() and "wrote" in stdout
    return out


def test_draft_compiles_and_accounts_for_every_field(drafted):
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.runtime.loading.hf_config import GENERIC_FIELDS

    text = drafted.read_text()
    assert text.startswith("# CHECKLIST"), text[:200]
    compiled = compile_spec(drafted)
    assert compiled.ir.architectures == (ARCH,) or list(compiled.ir.architectures) == [ARCH]
    doc = yaml.safe_load(text)
    import transformers
    fields = getattr(transformers, ARCH).config_class().to_dict()
    read = {p.split(".")[0] for e in doc["config"].values() for p in
            ([e["from"]] if isinstance(e.get("from"), str) else e.get("from") or [])}
    accounted = read | set(doc.get("config_assume") or {}) | set(doc.get("config_ignore") or []) | GENERIC_FIELDS
    checklist = "\n".join(l for l in text.splitlines() if l.startswith("# - [ ]"))
    missing = [f for f in fields if f not in accounted and f"`{f}`" not in checklist]
    assert not missing, f"config fields neither read, assumed, ignored nor on the checklist: {missing}"
    for flag in OVERRIDES:            # each bias flag is read and bound to a projection
        assert flag in doc["config"], flag
        assert re.search(rf"bias: {flag}\b", text), f"{flag} is read but bound to no projection"


def test_verify_accepts_the_drafted_spec(drafted, ckpt):
    rc, out, err = _cli("verify", str(drafted), str(ckpt), "--max-tokens", "8", "--prompt-lens", "3,17")
    assert rc == 0, out + err
    assert out.rstrip().endswith("OK") and "first divergence" not in out
    assert len(re.findall(r"decode steps' log-probabilities max error \d", out)) == 2, out
    assert "defaults: the fields read absent and null agree with transformers' " in out, out


def _variant(src: Path, dst: Path, old: str, new: str) -> Path:
    text = src.read_text()
    assert old in text, old
    dst.write_text(text.replace(old, new, 1))
    return dst


def test_verify_locates_a_wrong_norm_eps(drafted, ckpt):
    from xllm_gen.codegen.verify import verify

    bad = _variant(drafted, drafted.parent / "wrong_eps.yaml", "input_layernorm: {kind: rmsnorm, dim: hidden_size, "
                   "eps: rms_norm_eps}", "input_layernorm: {kind: rmsnorm, dim: hidden_size, eps: 0.5}")
    rc, out, _ = _cli("verify", str(bad), str(ckpt), "--max-tokens", "4", "--prompt-lens", "5")
    assert rc == 1 and "FAIL" in out
    assert "first divergence: layer 0, position 0" in out, out
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[5])
    assert not r.ok and r.first_divergence()[2].layer == 0


def test_verify_locates_a_late_divergence(drafted, ckpt):
    """A sliding window of 4 on the last layer only: the earlier layers agree; the last one diverges first at
    position 4 (the first query that would not see key 0)."""
    import json

    from xllm_gen.codegen.verify import verify
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    bad = _variant(drafted, drafted.parent / "late_window.yaml", "        head_dim: head_dim\n",
                   f"        head_dim: head_dim\n        sliding_window: \"4 if layer == {n - 1} else None\"\n")
    r = verify(bad, ckpt, max_tokens=6, prompt_lens=[3, 9])
    assert not r.ok
    _, _, e = r.first_divergence()
    assert (e.layer, e.first_bad_position) == (n - 1, 4), r.text()
    assert all(l.first_bad_position is None for p in r.prompts for l in p.layers[: n - 1]), r.text()
    assert f"first divergence: layer {n - 1}, position 4" in r.text()


def test_verify_compares_the_output_distribution(drafted, ckpt):
    """A wrong logit scale after the last layer keeps every argmax (greedy tokens and layer states agree) but changes
    every probability a sampler draws from: verify compares the log-probabilities too, and fails naming them."""
    import re as _re

    from xllm_gen.codegen.verify import verify
    text = drafted.read_text()
    line = _re.search(r"^lm_head: \{(.*)\}$", text, _re.M)
    assert line, "the drafted spec's lm_head line"
    bad = _variant(drafted, drafted.parent / "logit_scale.yaml", line.group(0),
                   "lm_head: {" + line.group(1) + ", logit_scale: 3.0}")
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[5])
    assert not r.ok and all(p.first_token_diff is None for p in r.prompts), r.text()
    assert r.first_divergence() is None and r.prompts[0].logprob_bad_position == 1, r.text()
    assert "log-probabilities max error" in r.text() and "DIFFER from position 1" in r.text()


def test_verify_reports_a_refusal_by_name(drafted, ckpt, tmp_path):
    from fixtures.tiny_hf import edit_config

    def add_window(cfg):
        cfg["sliding_window"] = 4
        cfg["use_sliding_window"] = True
    windowed = edit_config(ckpt, tmp_path / "windowed", add_window)
    rc, out, _ = _cli("verify", str(drafted), str(windowed), "--max-tokens", "2", "--prompt-lens", "3")
    assert rc == 1 and "REFUSED" in out and "sliding_window" in out, out


def test_draft_and_verify_errors_are_one_line(tmp_path):
    rc, _, err = _cli("draft", "NoSuchModelForCausalLM")
    assert rc == 2 and err.startswith("error:") and "NoSuchModelForCausalLM" in err
    rc, _, err = _cli("verify", str(ROOT / "specs" / "llama.yaml"), str(tmp_path))
    assert rc == 2 and "config.json" in err


@pytest.mark.parametrize("arch, expected", [
    # q/k norms are drafted (codegen/draft_attention.py), no longer only flagged
    ("Qwen3ForCausalLM", ["qk_norm: {kind: rmsnorm, eps: rms_norm_eps, q: q_norm, k: k_norm}"]),
    # the embedding's hidden_size ** 0.5 is drafted (codegen/draft_source.py), no longer only flagged
    ("Gemma2ForCausalLM", ["weight_offset: 1", "softcap", "post_feedforward_layernorm", "scale: embed_scale}"]),
    ("HeliumForCausalLM", ["interleaved"]),
    # Phi's parallel layer is now read from its forward (codegen/draft_layer.py), no longer refused
    ("PhiForCausalLM", ["- parallel: [{norm: input_layernorm, block: self_attn}", "fraction: partial_rotary_factor"]),
    # Falcon / Bloom name their MLP dense_h_to_4h / dense_4h_to_h: found (the draft failed on "no up/down MLP");
    # Falcon's parallel layer is now read as data flow under its flags (codegen/draft_flow.py, tests/test_draft_flow.py),
    # Bloom's fused per-head qkv and ALiBi flagged
    ("FalconForCausalLM", ["per: kv_group", "parallel: [{norm: ln_attn, block: self_attention}"]),
    ("BloomForCausalLM", ["query_key_value", "no rope parameters"]),
    # flags that add or remove parameters (q/k LayerNorms, the parallel residual's norm): read as symbols (they were
    # neither read nor assumed: every saved StableLM refused; then assumed at their defaults). Its per-head q / k
    # layernorm list is drafted; `use_parallel_residual` is the dataflow's choice (codegen/draft_flow.py: the form the
    # default layer runs is the one whose norms it builds, tests/test_draft_flow.py)
    ("StableLmForCausalLM", ["from: qk_layernorm", "if: \"use_parallel_residual\"", "name: stablelm"]),
    # transformers' own NemotronConfig defaults do not build (num_key_value_heads null): said, with the way out
    ("NemotronForCausalLM", ["null in num_key_value_heads", "draft from a checkpoint directory"]),
])
def test_draft_checklist_flags_what_a_llama_draft_misses(arch, expected):
    """Drafting by class name (no checkpoint): the checklist (or the error, for a non-Llama-like layer) names
    the features a Llama-like draft cannot express."""
    rc, out, err = _cli("draft", arch)
    text = out if rc == 0 else err
    assert rc in (0, 2), err
    for e in expected:
        assert e in text, f"{arch}: {e!r} not flagged:\n{text[:3000]}"


def test_draft_picks_the_language_model_of_several_layer_stacks():
    """Of several stacks of layers (a vision tower beside the language model, an encoder, a patcher) the draft takes
    the one not named as a tower or encoder, then the one with the most parameters, whatever the order the names come
    in (it took the first of a set's order: a new process could draft the vision tower instead)."""
    import random

    from xllm_gen.codegen.draft import Draft, _layer_prefix
    names = [f"model.vision_tower.encoder.layers.{{i}}.p{j}" for j in range(9)]
    names += [f"model.language_model.layers.{{i}}.p{j}" for j in range(5)]
    names += [f"model.patcher.layers.{{i}}.p{j}" for j in range(3)] + [f"model.extra.layers.{{i}}.p{j}" for j in range(4)]
    for seed in range(5):
        random.Random(seed).shuffle(names)
        assert _layer_prefix(Draft("X", "x", "X", {}), set(names)) == "model.language_model.layers.{i}."


def test_draft_of_fused_checkpoint_tensors_verifies(tiny_checkpoint, tmp_path):
    """A checkpoint that stores q/k/v and gate/up fused (Phi-3): the draft loads each as one tensor split into
    its segments (`weights: {param: {from: tensor}}`), flags the assumed order, and verifies."""
    ckpt = tiny_checkpoint("Phi3ForCausalLM", overrides={"sliding_window": None})
    out = tmp_path / "phi3_draft.yaml"
    rc, _, err = _cli("draft", str(ckpt), "-o", str(out), "--name", "phi3_draft")
    assert rc == 0, err
    text = out.read_text()
    assert "q/k/v fused in `self_attn.qkv_proj`" in text and "gate/up fused in `mlp.gate_up_proj`" in text
    assert "    from: model.layers.{i}.self_attn.qkv_proj.weight" in text
    rc, stdout, stderr = _cli("verify", str(out), str(ckpt), "--max-tokens", "6", "--prompt-lens", "4,12")
    assert rc == 0, stdout + stderr


def test_draft_of_moe_layers_verifies(tiny_checkpoint, tmp_path):
    """Mixture-of-experts layers (the draft refused them): Mixtral's router and experts are saved under other names than
    transformers holds them (block_sparse_moe.gate, experts.{e}.w1 / w3 / w2: the draft maps the names as saved, by
    reverting transformers' own conversion), and its routing renormalizes with no config flag (read from the modeling
    source); the drafted spec verifies. Qwen2-MoE: the shared expert with its sigmoid gate, and the dense layers that
    `mlp_only_layers` / `decoder_sparse_step` choose (every default layer is sparse: a probe config shows the dense MLP)."""
    ckpt = tiny_checkpoint("MixtralForCausalLM", overrides={})
    out = tmp_path / "mixtral_draft.yaml"
    rc, _, err = _cli("draft", str(ckpt), "-o", str(out), "--name", "mixtral_draft")
    assert rc == 0, err
    text = out.read_text()
    assert "kind: moe" in text and "norm_topk_prob: true" in text and "experts.{e}.w1.weight" in text
    assert "from: model.layers.{i}.block_sparse_moe.gate.weight" in text
    rc, stdout, stderr = _cli("verify", str(out), str(ckpt), "--max-tokens", "6", "--prompt-lens", "4,12")
    assert rc == 0, stdout + stderr
    rc, out2, err = _cli("draft", "Qwen2MoeForCausalLM")
    assert rc == 0, err
    assert "shared_expert: {name: shared_expert, intermediate: shared_expert_intermediate_size, gate: " \
           "shared_expert_gate}" in out2
    # the decoder layer's own condition, translated from its __init__ (codegen/draft_routing.py)
    assert 'block: {if: "layer not in mlp_only_layers and (num_experts > 0 and (layer + 1) % decoder_sparse_step == 0)' \
           '", then: moe, else: mlp, name: mlp}' in out2
    assert "gate: model.layers.{i}.mlp.shared_expert.gate_proj.weight" in out2


def test_compiler_cli_does_not_import_transformers():
    """draft and verify import transformers / torch lazily: the compiler and `--help` stay light."""
    import subprocess
    import sys
    code = ("import sys, xllm_gen.codegen.cli as c; c._parser(); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, "
            "[m for m in ('transformers', 'torch') if m in sys.modules]")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_draft_states_what_an_absent_field_means():
    """An absent num_key_value_heads / head_dim means the class's constant default where it has one (SeedOssConfig:
    8 KV heads whatever the heads), else what transformers computes from the heads (LlamaConfig): the draft writes
    `default: N` or the fallback accordingly."""
    import transformers

    from xllm_gen.codegen.draft import _fixed_default
    seed, llama = transformers.SeedOssConfig, transformers.LlamaConfig
    assert _fixed_default(seed, "num_key_value_heads") == seed.from_dict({"num_attention_heads": 96}).num_key_value_heads
    assert _fixed_default(llama, "num_key_value_heads") is None
    assert llama.from_dict({"num_attention_heads": 64}).num_key_value_heads == 64


def test_verify_checks_the_defaults_against_the_config_class(drafted, ckpt):
    """A wrong `default` passes every token and layer where the checkpoint writes the field (transformers 5 writes
    them all); verify also reads each field absent and null against the config class, so it fails naming it."""
    from xllm_gen.codegen.verify import verify

    text = drafted.read_text()
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("mlp_bias:"))
    bad = _variant(drafted, drafted.parent / "wrong_default.yaml", line,
                   line.replace("default: false", "default: true"))
    r = verify(bad, ckpt, max_tokens=2, prompt_lens=[3])
    assert all(p.first_token_diff is None for p in r.prompts) and not r.ok
    assert any(d.startswith("mlp_bias absent: transformers' SeedOssConfig means mlp_bias = False") for d in r.defaults)
    assert "default DIFFERS: mlp_bias absent" in r.text()
    # a symbol read from a nested path first (the rope mapping's theta, then the legacy top-level field): the mapping
    # and the field absent, as a Hub config without them (a blind Starcoder2 spec's theta default 1e5 passed)
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("rope_theta:"))
    bad = _variant(drafted, drafted.parent / "wrong_theta_default.yaml", line,
                   line.replace("default: 10000.0", "default: 100000.0"))
    r = verify(bad, ckpt, max_tokens=2, prompt_lens=[3])
    assert not r.ok and "default DIFFERS: rope_parameters.rope_theta / rope_theta absent: transformers' SeedOssConfig " \
        "means rope_parameters.rope_theta = 10000.0, the spec reads rope_theta = 100000.0" in r.text(), r.text()


def test_verify_compares_the_decode_steps(drafted, ckpt, monkeypatch):
    """A fault on the decode path alone (here a softmax scale 30% off in the paged decode attention) leaves the
    prefill, the teacher-forced layer states and the prompt's log-probabilities exact; the greedy run's per-step
    log-probabilities catch it, and the report says the prefill agrees."""
    from xllm_gen.codegen.verify import verify
    from xllm_gen.runtime.attention import torch_ref

    forward = torch_ref.TorchPagedBackend.forward

    def decode_fault(self, q, k, v, kc, vc, ctx, scale, *a, **kw):
        if ctx is not self._ctx:
            self.plan(ctx)
        return forward(self, q, k, v, kc, vc, ctx, scale * (1.3 if self._decode else 1.0), *a, **kw)
    monkeypatch.setattr(torch_ref.TorchPagedBackend, "forward", decode_fault)
    r = verify(drafted, ckpt, max_tokens=4, prompt_lens=[5])
    p = r.prompts[0]
    assert not r.ok and r.first_divergence() is None and p.logprob_bad_position is None, r.text()
    assert p.step_logprob_bad is not None and p.step_logprob_bad >= 1, r.text()   # step 0 is the prefill's
    assert "DIFFER from step 1" in r.text() and "the decode path" in r.text(), r.text()


@pytest.mark.slow      # two TP 2 engines (one process per rank)
def test_verify_at_tp2_serves_the_spec_under_test(drafted, ckpt):
    """`--tp 2`: the rank processes import the compiled spec by name (a user's generated/ directory preferred over
    a shipped package of the architecture), so a wrong spec fails at TP 2 as at TP 1 and the right one passes."""
    bad = _variant(drafted, drafted.parent / "wrong_eps_tp.yaml", "input_layernorm: {kind: rmsnorm, dim: hidden_size, "
                   "eps: rms_norm_eps}", "input_layernorm: {kind: rmsnorm, dim: hidden_size, eps: 0.5}")
    rc, out, _ = _cli("verify", str(drafted), str(ckpt), "--tp", "2", "--max-tokens", "4", "--prompt-lens", "5")
    assert rc == 0 and "TP 2" in out and "OK" in out, out
    rc, out, _ = _cli("verify", str(bad), str(ckpt), "--tp", "2", "--max-tokens", "4", "--prompt-lens", "5")
    assert rc == 1 and "first divergence: layer 0, position 0" in out, out


def test_verify_says_when_the_transformers_reference_fails(drafted, ckpt, monkeypatch):
    """A config transformers' modeling code cannot run (GPT-OSS with `sliding_window: null`): the error says the
    reference failed, not a bare exception as if the spec or the checkpoint were wrong."""
    import json

    import transformers

    from xllm_gen.codegen.verify import VerifyError, verify
    cls = getattr(transformers, json.loads((ckpt / "config.json").read_text())["architectures"][0])

    def broken(self, *a, **k):
        raise TypeError("'NoneType' object cannot be interpreted as an integer")
    monkeypatch.setattr(cls, "forward", broken)
    with pytest.raises(VerifyError, match=rf"the transformers reference failed: {cls.__name__} .*raised TypeError"):
        verify(drafted, ckpt, max_tokens=2, prompt_lens=[3])


def test_verify_notes_a_window_its_sequences_never_reach():
    """A real config's window (4096) is longer than verify's sequences: a wrong window size or pattern would pass, so
    the report says the window was not exercised (a note, not a failure); a reached window gets no note."""
    import torch

    from xllm_gen.codegen.verify import _unexercised
    from xllm_gen.runtime.attention.base import AttentionVariant

    class Attn(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.variant = AttentionVariant(sliding_window=window)
    model = torch.nn.Sequential(Attn(4096), Attn(None), Attn(6))
    notes = _unexercised(model, 46)
    assert notes == ["sliding window 4096 not exercised: the longest sequence is 46 tokens (--prompt-lens beyond it, "
                     "or a checkpoint with a smaller window, would test it)"], notes
    assert _unexercised(torch.nn.Sequential(Attn(6)), 46) == []


def test_verify_notes_longrope_long_factor_it_never_reaches():
    """longrope: verify's context (its longest sequence) keeps short_factor, while a deployment at the default
    max_model_len (past the original context) takes long_factor at every position, so a spec that never turns to
    long_factor would pass; the report says so. So does a rotary pinned to short factors whose attention factor
    differs by regime (Phi-3.5-MoE's short_mscale / long_mscale). Sequences past the original context, or short factors
    with one attention factor, get no note."""
    import torch

    from xllm_gen.codegen.verify import _unexercised
    from xllm_gen.runtime.layers.rotary import Rotary

    def rot(factors="by_context", mscales=None):
        return Rotary(16, 10000.0, 8192, scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                                  "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                  **(mscales or {})},
                      longrope_factors=factors, longrope_mscale=mscales is not None)
    notes = _unexercised(torch.nn.Sequential(rot(), rot()), 46)
    assert len(notes) == 1 and notes[0].startswith("longrope's long-context regime (long_factor / long_mscale) not "
                                                   "exercised: the longest sequence is 46 tokens, within the original "
                                                   "context 4096"), notes
    assert _unexercised(torch.nn.Sequential(rot()), 5000) == []
    assert _unexercised(torch.nn.Sequential(rot("short")), 46) == []
    assert len(_unexercised(torch.nn.Sequential(rot("short", {"short_mscale": 1.1, "long_mscale": 1.2})), 46)) == 1
    assert _unexercised(torch.nn.Sequential(rot("short", {"short_mscale": 1.1, "long_mscale": 1.1})), 46) == []


def test_verify_in_bfloat16_measures_against_float32(drafted, ckpt):
    """--dtype bfloat16: the reference is transformers in float32 and transformers' own bfloat16 run the yardstick
    (the engine may be a few times as far from float32 as transformers' bfloat16 is, and a greedy token may differ
    only at a near-tie); a wrong eps still fails at layer 0."""
    from xllm_gen.codegen.verify import verify
    r = verify(drafted, ckpt, dtype="bfloat16", max_tokens=6, prompt_lens=[5, 17])
    assert r.ok, r.text()
    assert "reference: transformers in float32" in r.text()
    bad = _variant(drafted, drafted.parent / "wrong_eps_bf16.yaml", "input_layernorm: {kind: rmsnorm, dim: hidden_size, "
                   "eps: rms_norm_eps}", "input_layernorm: {kind: rmsnorm, dim: hidden_size, eps: 0.5}")
    r = verify(bad, ckpt, dtype="bfloat16", max_tokens=4, prompt_lens=[5])
    assert not r.ok and r.first_divergence()[2].layer == 0, r.text()


def test_verify_in_bfloat16_sets_moe_routing_ties_aside(tmp_path):
    """--dtype bfloat16 on an MoE spec: positions whose experts bf16 rounding may change (the engine's routing against
    its own float32 run, codegen/verify_routing.py) are compared by no measure and counted; a spec that routes by
    another score (softmax for GLM-4-MoE's sigmoid) still fails."""
    from fixtures.tiny_hf import make_tiny_checkpoint

    from xllm_gen.codegen.verify import verify
    ckpt = make_tiny_checkpoint("Glm4MoeForCausalLM", tmp_path / "ckpt", seed=0)
    spec = Path(__file__).resolve().parents[1] / "specs" / "glm4_moe.yaml"
    r = verify(spec, ckpt, dtype="bfloat16", max_tokens=4, prompt_lens=[9, 30])
    assert r.ok, r.text()
    assert all(p.routing_error is None for p in r.prompts) and sum(p.routing_ties for p in r.prompts) > 0, r.text()
    specs = tmp_path / "specs"          # beside the specs it extends
    specs.mkdir()
    for f in spec.parent.glob("*.yaml"):
        (specs / f.name).write_text(f.read_text())
    bad = _variant(spec, specs / "glm4_moe.yaml", "scoring: sigmoid", "scoring: softmax")
    r = verify(bad, ckpt, dtype="bfloat16", max_tokens=4, prompt_lens=[9, 30])
    assert not r.ok, r.text()


def test_verify_says_when_its_own_sequences_do_not_fit(drafted, ckpt):
    """Prompts + new tokens longer than the checkpoint admits: verify's own choice, named as such (with the flags to
    change), not 'the engine cannot load the checkpoint with this spec'."""
    import json

    from xllm_gen.codegen.verify import VerifyError, verify
    longest = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(VerifyError, match=r"verify's longest sequence .* --prompt-lens or fewer --max-tokens"):
        verify(drafted, ckpt, max_tokens=4, prompt_lens=[longest])


def test_verify_checks_defaults_under_a_remote_code_architecture_name():
    """config.json naming the remote-code class (mosaicml's MPTForCausalLM, which transformers does not ship): the
    reference is the Auto class, which reads config.json by model_type, so the spec's defaults are checked against
    that model_type's config class (they were silently skipped); a model_type transformers lacks has none."""
    import transformers

    from xllm_gen.codegen.verify import _model_type_class
    report = type("R", (), {"reference": None})()
    cls, config_cls = _model_type_class(transformers.AutoModelForCausalLM, "mpt", report)
    assert cls is transformers.AutoModelForCausalLM and config_cls is transformers.MptConfig
    assert report.reference is None
    assert _model_type_class(transformers.AutoModelForCausalLM, "no_such_type", report)[1] is None


def test_verify_float32_bounds_catch_a_gelu_approximation(tmp_path):
    """float32 verify bounds each layer by transformers' own float32 error against its float64 run: an erf GELU
    written for BLOOM's tanh one fails at layer 0 on a checkpoint whose MLP inputs are small (dense_h_to_4h x 0.35:
    6e-5 relative, which the fixed 1e-4 of --atol passes); the right spec passes with the bound printed."""

    from fixtures.tiny_hf import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    from xllm_gen.codegen.verify import verify
    ckpt = make_tiny_checkpoint("BloomForCausalLM", tmp_path / "ckpt", seed=0)
    for f in ckpt.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v * 0.35 if "dense_h_to_4h.weight" in k else v for k, v in t.items()}, str(f),
                  metadata={"format": "pt"})
    spec = Path(__file__).resolve().parents[1] / "specs" / "bloom.yaml"
    ok = verify(spec, ckpt, max_tokens=3, prompt_lens=[5, 17])
    assert ok.ok and "float64 run" in ok.text(), ok.text()
    wrong = _variant(spec, tmp_path / "bloom.yaml", "activation: gelu_pytorch_tanh ", "activation: gelu ")
    bad = verify(wrong, ckpt, max_tokens=3, prompt_lens=[5, 17])
    assert not bad.ok and bad.first_divergence()[2].layer == 0, bad.text()
    assert verify(wrong, ckpt, max_tokens=3, prompt_lens=[5, 17], rtol=1e-4).ok     # what the fixed bound missed


def test_verify_follows_transformers_own_forward_where_its_cache_leaves_it():
    """Where transformers' cached generate leaves its own uncached forward (the forward's argmax is another token),
    the engine is judged against that forward from there on: it must take the forward's argmax at every later step
    too; an engine that leaves both is still a difference."""
    import torch

    from xllm_gen.codegen.verify_compare import _follows_own_forward

    best = {(): 5, (5,): 7, (5, 7): 2, (5, 9): 4}            # the forward's argmax after each prefix

    def row(k, prefix):
        out = torch.zeros(10)
        out[best[tuple(prefix)]] = 1.0
        return out
    assert _follows_own_forward(row, [5, 9, 4], [5, 7, 2]) == (1, 9, 7)     # generate's 9, the forward's 7
    assert _follows_own_forward(row, [5, 7, 2], [5, 7, 2]) is None          # no difference
    assert _follows_own_forward(row, [5, 7, 2], [5, 9, 4]) is None          # generate follows the forward
    assert _follows_own_forward(row, [5, 9, 4], [5, 7, 3]) is None          # the engine leaves the forward later


def test_verify_gemma3_window_of_one_token(tmp_path):
    """Gemma 3 with sliding_window 1 (each sliding layer's token sees itself only): transformers 5.25's generate
    disagrees with its own forward there; the engine follows the forward at every step, layer and log-probability,
    and verify says which side moved."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from xllm_gen.codegen.verify import verify
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=1,
                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "c")
    r = verify(Path(__file__).resolve().parents[1] / "specs" / "gemma3.yaml", tmp_path / "c", max_tokens=4,
               prompt_lens=[3, 9])
    assert r.ok, r.text()
    assert all(p.first_token_diff is None or p.own_forward is not None for p in r.prompts), r.text()


def test_verify_notes_tensors_transformers_changed_at_load(ckpt):
    """A reference whose loading changed a tensor (transformers 5.25's Mamba init divides the loaded out_proj by
    sqrt(layers) under rescale_prenorm_residual) is not the file's model: verify names the tensor; an unchanged
    load gives no note."""
    import torch
    from transformers import AutoModelForCausalLM

    from xllm_gen.codegen.verify_compare import loaded_weights_note
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    assert loaded_weights_note(hf, ckpt) == []
    name, p = next((n, p) for n, p in hf.named_parameters() if n.endswith("o_proj.weight"))
    with torch.no_grad():
        p /= 3 ** 0.5
    note = loaded_weights_note(hf, ckpt)
    assert len(note) == 1 and name in note[0] and "1.732x" in note[0], note


def test_verify_fails_where_transformers_left_a_tensor_at_random_init(tmp_path):
    """A Mamba checkpoint under mamba_ssm's name `backbone.embedding.weight`: the spec reads it (checkpoint_renames),
    transformers 5.25 does not and leaves its embedding at random init. verify says so, and FAILS: its float64
    yardstick used to load its own random embedding, measured that as transformers' own float32 error, and passed
    an engine 4 nats away at 10x of it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, MambaConfig

    from xllm_gen.codegen.verify import verify
    cfg = MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "c")
    f = tmp_path / "c" / "model.safetensors"
    tensors = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f), metadata={"format": "pt"})
    r = verify(Path(__file__).resolve().parents[1] / "specs" / "mamba.yaml", tmp_path / "c", max_tokens=2,
               prompt_lens=[4])
    assert not r.ok, r.text()
    assert any("did not find" in n and "backbone.embeddings.weight" in n for n in r.notes), r.notes


def test_verify_notes_on_a_checkpoint_with_an_empty_tensor(tmp_path):
    """A tensor of zero elements (transformers saves a [0, hidden] shared expert where num_shared_experts is 0) is no
    loading change: the check of transformers' loaded weights failed on it with a bare `max(): Expected reduction dim`
    (a blind exercise), instead of letting the spec's refusal name the tensors."""
    import torch
    from safetensors.torch import save_file

    from xllm_gen.codegen.verify_compare import loaded_weights_note

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.empty = torch.nn.Parameter(torch.zeros(0, 4))
            self.w = torch.nn.Parameter(torch.ones(2, 4))

    save_file({"empty": torch.zeros(0, 4), "w": torch.ones(2, 4)}, str(tmp_path / "model.safetensors"))
    assert loaded_weights_note(M(), tmp_path) == []
    save_file({"empty": torch.zeros(0, 4), "w": 2 * torch.ones(2, 4)}, str(tmp_path / "model.safetensors"))
    assert "w (max |value| 2x" in " ".join(loaded_weights_note(M(), tmp_path))


@pytest.mark.slow       # one verify of a LongCat-Flash checkpoint (~40 s)
def test_verify_compares_the_layers_the_spec_builds_and_the_final_norm(tiny_checkpoint):
    """LongCat-Flash's config counts num_layers decoder layers, each two sublayers (transformers' num_hidden_layers is
    twice that): verify looked for a list of num_hidden_layers modules, compared no layer and blamed "after the last
    layer" for a wrong latent eps (a blind exercise). It now takes the spec's own layer count, and compares the final
    norm's output as one more stage."""
    ckpt = tiny_checkpoint("LongcatFlashForCausalLM", overrides={})
    rc, out, err = _cli("verify", str(ROOT / "specs" / "longcat_flash.yaml"), str(ckpt), "--max-tokens", "4",
                        "--prompt-lens", "4,12")
    assert rc == 0, out + err
    line = next(l for l in out.splitlines() if l.startswith("per-layer max relative error"))
    assert " 0:" in line and " 1:" in line and " norm:" in line, line
