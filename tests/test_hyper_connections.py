"""Hyper-connections (the `hyper_connection` block kind, `{hyper: HC}` steps, `decoder.hyper_head`;
runtime/layers/hyper_connection.py) against transformers' own modules, float32 on CPU:

- the fused form with a Sinkhorn residual mix is DeepSeek-V4's mHC (`DeepseekV4HyperConnection`: pre, post, comb and
  the collapsed block input; the merge is its decoder layer's formula) and its final `DeepseekV4HyperHead`;
- the fused form without a mix, a post magnitude and eps, is HY-V4's iHC (`HYV4HyperConnection`, `HYV4HyperHead`);
- the low-rank form is Qwen4-Exp's `Qwen4ExpTextGatedResidual` (with and without its output weights);
- Qwen4-Exp served (specs/qwen4_exp.yaml): greedy parity with transformers; the sensitivity arm: the output weights
  made uniform (block_inject_weight zeroed: every stream takes 1 * h) change transformers' tokens and the engine
  follows; identity-like streams (the merge ignoring the per-stream weights) diverge;
- the guard refuses the QSA attention layers, the n-gram per-layer embeddings and the sigmoid output gate by name;
- the compiler: a hyper step without decoder.hyper_head, a plain step beside hyper steps, a low_rank form with a mix;
- the fused form served end to end (a Llama child spec with Sinkhorn-mixed streams around its normed steps): with
  coefficients that keep the streams equal it gives transformers' Llama tokens; random projections change them.
The features-ON conformance arm (TP 1, TP 2 slow) is tests/conformance's; the served arm here is slow.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xllm_gen.runtime.layers.hyper_connection import HyperConnection, expand_streams

T, N, D = 5, 3, 16
SPECS = Path(__file__).resolve().parents[1] / "specs"


def _rand_(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _streams(seed=1):
    return torch.randn(T, N, D, generator=torch.Generator().manual_seed(seed))


def test_fused_sinkhorn_is_deepseek_v4_mhc():
    from transformers.models.deepseek_v4 import configuration_deepseek_v4 as C
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
    cfg = C.DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=5, hc_eps=1e-3, rms_norm_eps=1e-6)
    hf = M.DeepseekV4HyperConnection(cfg).float().eval()
    _rand_([hf.fn, hf.base, hf.scale])
    ours = HyperConnection(N, D, "fused", 1e-6, pre_eps=1e-3, magnitude=2.0, mix=True, sinkhorn_iters=5,
                           mix_eps=1e-3)
    ours.load_state_dict({"fn": hf.fn, "base": hf.base, "scale": hf.scale})
    s = _streams()
    post, comb, collapsed = hf(s.unsqueeze(0))
    x, p, m = ours(s)
    torch.testing.assert_close(x, collapsed[0])
    torch.testing.assert_close(p, post[0])
    torch.testing.assert_close(m, comb[0])
    h = torch.randn(T, D)
    want = post[0].unsqueeze(-1) * h.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), s)
    torch.testing.assert_close(ours.merge(s, h, p, m), want)
    # the mix is doubly stochastic and load-bearing: the identity instead changes the streams
    torch.testing.assert_close(m.sum(-2), torch.ones(T, N), atol=1e-2, rtol=0)
    assert not torch.allclose(ours.merge(s, h, p, None), want, atol=1e-3)

    head = M.DeepseekV4HyperHead(cfg).float().eval()
    _rand_([head.hc_fn, head.hc_base, head.hc_scale], seed=2)
    oh = HyperConnection(N, D, "fused", 1e-6, pre_eps=1e-3, post=False)
    oh.load_state_dict({"fn": head.hc_fn, "base": head.hc_base, "scale": head.hc_scale})
    torch.testing.assert_close(oh(s)[0], head(s.unsqueeze(0))[0])


def test_fused_identity_is_hy_v4_ihc():
    from transformers.models.hy_v4 import modeling_hy_v4 as M
    from transformers.models.hy_v4.configuration_hy_v4 import HYV4Config
    cfg = HYV4Config(hidden_size=D, hc_mult=N, hc_magnitude=1.5, hc_eps=1e-3, rms_norm_eps=1e-5,
                     num_hidden_layers=2, vocab_size=32)
    hf = M.HYV4HyperConnection(cfg).float().eval()
    _rand_([hf.fn, hf.base, hf.scale])
    ours = HyperConnection(N, D, "fused", 1e-5, pre_eps=1e-3, magnitude=1.5, post_eps=1e-3)
    ours.load_state_dict({"fn": hf.fn, "base": hf.base, "scale": hf.scale})
    s = _streams()
    post, out = hf(s.unsqueeze(0))
    x, p, m = ours(s)
    assert m is None
    torch.testing.assert_close(x, out[0])
    torch.testing.assert_close(p, post[0])
    h = torch.randn(T, D)
    torch.testing.assert_close(ours.merge(s, h, p, m), post[0].unsqueeze(-1) * h.unsqueeze(-2) + s)
    head = M.HYV4HyperHead(cfg).float().eval()
    _rand_([head.hc_fn, head.hc_base, head.hc_scale], seed=2)
    oh = HyperConnection(N, D, "fused", 1e-5, pre_eps=1e-3, post=False)
    oh.load_state_dict({"fn": head.hc_fn, "base": head.hc_base, "scale": head.hc_scale})
    torch.testing.assert_close(oh(s)[0], head(s.unsqueeze(0))[0])


def test_low_rank_is_qwen4_exp_gated_residual():
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    cfg = Qwen4ExpTextConfig(hidden_size=D, hc_count=N, hc_lowrank=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["linear_attention"])
    for combine in (True, False):
        hf = M.Qwen4ExpTextGatedResidual(cfg, use_combine=combine).float().eval()
        _rand_(list(hf.parameters()))
        ours = HyperConnection(N, D, "low_rank", 1e-6, norm_weight=True, norm_offset=1.0, per_stream=True, rank=4,
                               magnitude=2.0, post=combine)
        ours.load_state_dict(hf.state_dict())
        s = _streams()
        out = hf(s.flatten(-2).unsqueeze(0))
        x, p, m = ours(s)
        assert m is None
        torch.testing.assert_close(x, (out[0] if combine else out)[0])
        if combine:
            torch.testing.assert_close(p, out[2][0])
            h = torch.randn(T, D)
            want = out[1][0] + (h.unsqueeze(-2) * out[2][0].unsqueeze(-1)).flatten(-2)
            torch.testing.assert_close(ours.merge(s, h, p, m).flatten(-2), want)


def test_expand_streams():
    h = torch.randn(T, D)
    s = expand_streams(h, N)
    assert s.shape == (T, N, D) and s.is_contiguous() and torch.equal(s[:, 2], h)


# ---------------------------------------------------------------------------------------------- Qwen4-Exp served
ARCH = "Qwen4ExpForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77], [7, 8, 9]]
MAX_TOKENS = 6


def _hf(ckpt):
    from hf_ref import hf_greedy
    return hf_greedy(ckpt, PROMPTS, MAX_TOKENS)


def _engine(ckpt, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_qwen4_exp_features_on_short(tiny_checkpoint):
    """The default arm of the conformance battery's features-ON parity for Qwen4-Exp (slow there: transformers
    generates it without a cache): the same features-ON checkpoint, two short prompts, 6 new tokens."""
    from conformance import families as F
    plan = next(p for p in F.served_plans() if p.family.architecture == ARCH)
    assert plan.status == "served" and plan.accepted, plan
    ckpt = tiny_checkpoint(ARCH, overrides=plan.overrides)
    want = _hf(ckpt)
    assert want != _hf(tiny_checkpoint(ARCH)), "the features ON do not change transformers' tokens"
    assert _engine(ckpt) == want


@pytest.mark.slow   # minutes: transformers runs Qwen4-Exp without a cache (a cache of DeltaNet layers only fails)
def test_qwen4_exp_parity_and_sensitivity(tiny_checkpoint, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_checkpoint(ARCH)
    want = _hf(src)
    assert _engine(src) == want
    # uniform output weights: block_inject_weight zeroed gives every stream 2 * sigmoid(0) * h = h
    ckpt = tmp_path / "uniform_post"
    shutil.copytree(src, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    hit = [k for k in tensors if k.endswith("block_inject_weight.weight")]
    assert hit
    for k in hit:
        tensors[k] = torch.zeros_like(tensors[k])
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    uniform = _hf(ckpt)
    assert uniform != want, "uniform output weights did not change transformers' tokens"
    assert _engine(ckpt) == uniform
    # the engine's merge without the per-stream weights (each stream += h) diverges from transformers
    monkeypatch.setattr(HyperConnection, "merge",
                        lambda self, s, h, post, mix: (s.float() + h.float().unsqueeze(-2)).to(s.dtype))
    assert _engine(src) != want


@pytest.mark.parametrize("field,value", [
    ("layer_types", ["linear_attention", "indexed_attention", "linear_attention"]),
    ("ple_layer_ids", [1]),
    ("output_gate_type", "sigmoid"),
])
def test_qwen4_exp_guard_refuses_by_name(field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.qwen4_exp.model import Config
    base = tiny_config(ARCH).to_dict()
    Config.from_hf(base)
    name = "indexed_attention_layers" if field == "layer_types" else field
    with pytest.raises(Exception, match=name):
        Config.from_hf({**base, field: value})


# ---------------------------------------------------------------------------------------------------- compiler
_HC = ("{kind: hyper_connection, streams: 2, dim: hidden_size, norm: {eps: 1.0e-6}, post: {magnitude: 2.0}, "
       "mix: {sinkhorn_iters: 3}}")


def _compile(tmp_path, dataflow: str, head: bool = True, hc: str = _HC):
    from codegen.errors import SpecError
    from codegen.loader import load_spec
    from codegen.resolver import resolve
    text = f"""
extends: {SPECS / 'llama.yaml'}
name: hc_llama
class_prefix: HcLlama
architectures: [HcLlamaForCausalLM]
decoder:
  layers:
    blocks:
      attn_hc: {hc}
""" + (f"      mlp_hc: {hc}\n" if "mlp_hc" in dataflow else "") + f"""    dataflow: {dataflow}
""" + ("""  hyper_head: {kind: hyper_connection, streams: 2, dim: hidden_size, norm: {eps: 1.0e-6}}
""" if head else "") + "variants: {Llama-3.2-1B: ~, Llama-3.1-8B: ~}\n"
    p = tmp_path / "hc_llama.yaml"
    p.write_text(text)
    try:
        return resolve(load_spec(p)), None
    except SpecError as e:
        return None, str(e)


HYPER_FLOW = ("[{hyper: attn_hc, norm: input_layernorm, block: self_attn}, "
              "{hyper: mlp_hc, norm: post_attention_layernorm, block: mlp}]")


def test_compiler_accepts_hyper_llama(tmp_path):
    ir, err = _compile(tmp_path, HYPER_FLOW)
    assert err is None, err
    names = [p.name for p in ir.params]
    assert "model.layers.{i}.attn_hc.fn" in names and "model.hyper_head.scale" in names
    fn = next(p for p in ir.params if p.name == "model.layers.{i}.attn_hc.fn")
    assert fn.shape[0].eval({}) == 8 and fn.shard == "replicated"      # 2n + n^2 logits for n = 2


@pytest.mark.parametrize("flow,head,hc,needle", [
    (HYPER_FLOW, False, _HC, "decoder.hyper_head"),
    ("[{hyper: attn_hc, norm: input_layernorm, block: self_attn}, {norm: post_attention_layernorm, block: mlp}]",
     True, _HC, "every step is a"),
    (HYPER_FLOW, True, "{kind: hyper_connection, streams: 2, dim: hidden_size, norm: {eps: 1.0e-6}, form: low_rank, "
                       "rank: 4, post: {}, mix: {sinkhorn_iters: 3}}", "no residual mix"),
    (HYPER_FLOW, True, "{kind: hyper_connection, streams: 3, dim: hidden_size, norm: {eps: 1.0e-6}, post: {}}",
     "streams"),
])
def test_compiler_refusals(tmp_path, flow, head, hc, needle):
    ir, err = _compile(tmp_path, flow, head, hc)
    assert err is not None and needle in err, err


# ------------------------------------------------------------------------------- the fused form served end to end
HC_LLAMA = """extends: {llama}
name: hc_llama
class_prefix: HcLlama
architectures: [HcLlamaForCausalLM]
decoder:
  layers:
    blocks:
      attn_hc: &hc
        kind: hyper_connection
        streams: 2
        dim: hidden_size
        norm: {{eps: 1.0e-6}}
        post: {{magnitude: 2.0}}
        mix: {{sinkhorn_iters: 3}}
      mlp_hc: *hc
    dataflow:
      - {{hyper: attn_hc, norm: input_layernorm, block: self_attn}}
      - {{hyper: mlp_hc, norm: post_attention_layernorm, block: mlp}}
  hyper_head: {{kind: hyper_connection, streams: 2, dim: hidden_size, norm: {{eps: 1.0e-6}}}}
variants: {{Llama-3.2-1B: ~, Llama-3.1-8B: ~}}
"""


def _hc_tensors(layers: int, dim: int, random: bool) -> dict:
    """Coefficients that make 2 streams carry Llama's one residual exactly: pre 1/2 each (fn 0, base logit(1/2)),
    post 1 (2 * sigmoid(0)), mix the identity (a +-30 diagonal softmax); `random`: fn drawn at random instead."""
    g = torch.Generator().manual_seed(3)
    n = 2
    base = torch.cat([torch.zeros(n), torch.zeros(n), (torch.eye(n) * 60 - 30).flatten()])
    out = {}
    for i in range(layers):
        for hc in ("attn_hc", "mlp_hc"):
            fn = torch.randn(2 * n + n * n, n * dim, generator=g) * 0.3 if random else torch.zeros(2 * n + n * n, n * dim)
            out |= {f"model.layers.{i}.{hc}.fn": fn, f"model.layers.{i}.{hc}.base": base.clone(),
                    f"model.layers.{i}.{hc}.scale": torch.ones(3)}
    out |= {"model.hyper_head.fn": torch.zeros(n, n * dim), "model.hyper_head.base": torch.zeros(n),
            "model.hyper_head.scale": torch.ones(1)}
    return out


def test_fused_form_served_end_to_end(tiny_checkpoint, tmp_path, monkeypatch):
    """A Llama with DeepSeek-V4-style hyper-connections around its normed steps (fused form, Sinkhorn mix), compiled
    from a child spec into a user generated/ dir: with coefficients that keep the streams equal it gives Llama's own
    greedy tokens (transformers); with random projections the tokens change (the mixers are in the path)."""
    import json
    import shutil

    from hf_ref import hf_greedy
    from safetensors.torch import load_file, save_file

    from xllm_gen.codegen.cli import main as cli_main
    spec = tmp_path / "hc_llama.yaml"
    spec.write_text(HC_LLAMA.format(llama=SPECS / "llama.yaml"))
    assert cli_main([str(spec), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    src = tiny_checkpoint("LlamaForCausalLM")
    want = hf_greedy(src, PROMPTS, MAX_TOKENS)
    cfg = json.loads((src / "config.json").read_text())
    got = {}
    for random in (False, True):
        ckpt = tmp_path / f"hc_{random}"
        shutil.copytree(src, ckpt)
        tensors = load_file(str(ckpt / "model.safetensors"))
        tensors |= _hc_tensors(cfg["num_hidden_layers"], cfg["hidden_size"], random)
        save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["HcLlamaForCausalLM"]}))
        got[random] = _engine(ckpt)
    assert got[False] == want
    assert got[True] != want
