"""Norm and dataflow primitives: projection-wide q/k norms (and their TP reduction), LayerNorm / RMSNorm forms,
clip_qkv, post-norm-only steps, and a dataflow chosen by a config flag.

Sensitivity arms: each feature is changed in a tiny checkpoint (weights perturbed, a config value changed); the
change must move transformers' greedy tokens, and the engine must still produce transformers' tokens. The spec
battery (tests/test_spec_battery.py) covers plain parity of specs/olmo.yaml, olmo2.yaml and olmoe.yaml at TP 1
and 2. q/k norm forms no shipped spec uses (LayerNorm with bias, (1 + w), RMSNorm with bias, a weight per head,
after rotary) are written into HF Qwen3's q_norm / k_norm slots and served by a spec extending qwen3.yaml; the
dataflow chosen by a config flag is the README's stablelm example, served in both forms.
"""
from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xllm_gen.runtime.layers import norm as norm_mod

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENS = (4, 11, 19)
MAX_TOKENS = 12


# -------------------------------------------------------------------------------------------- layers
class _FakeGroup:
    """A TP group of threads: all_reduce sums a tensor over the ranks (each rank's thread calls it in turn)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size
        self.local = threading.local()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.slots[self.local.rank] = t
        self.barrier.wait()
        out = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        return out


def _sharded_outputs(monkeypatch, kind, heads, head_dim, tp, x, weight, bias, replicate_ok):
    """Each rank's ProjectionNorm output (threads as ranks, each loading its shard of the weights through the
    layer's own weight loader), concatenated over the distinct shards."""
    group = _FakeGroup(tp)
    monkeypatch.setattr(norm_mod, "all_reduce", group.all_reduce)
    monkeypatch.setattr(norm_mod, "get_tp_size", lambda: tp)
    monkeypatch.setattr(norm_mod, "get_tp_rank", lambda: group.local.rank)
    outs, errors = [None] * tp, []

    def run(rank):
        try:
            group.local.rank = rank
            m = norm_mod.ProjectionNorm(kind, heads, head_dim, 1e-5, bias=bias is not None, replicate_ok=replicate_ok)
            m.weight.weight_loader(m.weight, weight)
            if bias is not None:
                m.bias.weight_loader(m.bias, bias)
            seg = m.weight.tp_split.segments[0]
            with torch.no_grad():
                outs[rank] = (seg.start, m(x[:, seg.start:seg.stop]))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    shards = dict(outs)             # replicated shards: one of each
    return torch.cat([shards[a] for a in sorted(shards)], dim=-1)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("heads, tp", [(4, 2), (1, 2), (2, 4)], ids=["split", "replicated", "replicated4"])
def test_projection_norm_under_tp_equals_the_whole_projection_norm(monkeypatch, kind, heads, tp):
    """The TP form of a projection-wide norm (local statistics all-reduced) equals the norm of the whole
    projection, also where the heads are fewer than the ranks and replicated (KV heads)."""
    torch.manual_seed(0)
    D = 8
    x = torch.randn(5, heads * D) * 3 + 1
    w, b = torch.randn(heads * D), torch.randn(heads * D)
    got = _sharded_outputs(monkeypatch, kind, heads, D, tp, x, w, b if kind == "layernorm" else None,
                           replicate_ok=heads < tp)
    if kind == "rmsnorm":
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    else:
        want = F.layer_norm(x, (heads * D,), w, b, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind == "rmsnorm" and heads > 1:   # the projection-wide norm is not the per-head one
        per_head = x.view(5, heads, D)
        ph = (per_head * torch.rsqrt(per_head.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(5, -1) * w
        assert not torch.allclose(ph, want, rtol=1e-3, atol=1e-3)


def test_projection_norm_at_tp1_is_the_norm():
    torch.manual_seed(1)
    x = torch.randn(3, 32)
    m = norm_mod.ProjectionNorm("layernorm", 4, 8, 1e-5, bias=True)
    with torch.no_grad():
        m.weight.copy_(torch.randn(32))
        m.bias.copy_(torch.randn(32))
    torch.testing.assert_close(m(x), F.layer_norm(x, (32,), m.weight, m.bias, 1e-5), rtol=0, atol=0)
    r = norm_mod.ProjectionNorm("rmsnorm", 4, 8, 1e-6, weight_offset=1.0)
    with torch.no_grad():
        r.weight.copy_(torch.randn(32))
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1 + r.weight)
    torch.testing.assert_close(r(x), want)


def test_layernorm_and_rmsnorm_forms():
    torch.manual_seed(2)
    x, res = torch.randn(4, 16), torch.randn(4, 16)
    bare = norm_mod.LayerNorm(16, 1e-5, bias=False, weight=False)
    assert list(bare.parameters()) == []
    y, r = bare(x, res)
    torch.testing.assert_close(y, F.layer_norm(x + res, (16,), eps=1e-5), rtol=0, atol=0)
    torch.testing.assert_close(r, x + res, rtol=0, atol=0)
    one_p = norm_mod.LayerNorm(16, 1e-5, bias=True, weight_offset=1.0)
    with torch.no_grad():
        one_p.weight.copy_(torch.randn(16))
        one_p.bias.copy_(torch.randn(16))
    torch.testing.assert_close(one_p(x), F.layer_norm(x, (16,), one_p.weight + 1, one_p.bias, 1e-5))
    rb = norm_mod.RMSNorm(16, 1e-6, bias=True)
    with torch.no_grad():
        rb.weight.copy_(torch.randn(16))
        rb.bias.copy_(torch.randn(16))
    y, r = rb(x, res)
    h = x + res
    torch.testing.assert_close(y, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * rb.weight + rb.bias)


# -------------------------------------------------------------------------------------------- engine arms
def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 490, n).tolist() for n in PROMPT_LENS]


def _engine(ckpt: Path, tp: int = 1) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)]


def _hf(ckpt: Path) -> list[list[int]]:
    from hf_ref import hf_greedy
    return [hf_greedy(ckpt, [p], MAX_TOKENS)[0] for p in _prompts()]


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` at `dst` whose tensors are `edit(name, tensor)` (None: unchanged)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    hits = 0
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            for name, t in list(tensors.items()):
                new = edit(name, t)
                if new is not None:
                    tensors[name], hits = new.contiguous(), hits + 1
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    assert hits, "the edit matched no tensor"
    return dst


def _arm(base: Path, arm: Path, what: str):
    """The arm moves transformers' tokens, and the engine serves transformers' tokens on it."""
    want = _hf(arm)
    assert want != _hf(base), f"{what} does not change transformers' output: the arm tests nothing"
    assert _engine(arm) == want, f"{what}: engine != transformers"


def test_projection_qk_norm_weights_matter(tiny_checkpoint, tmp_path):
    """OLMo 2: the q/k norm weights over the whole projection, scaled per column, change the tokens."""
    base = tiny_checkpoint("Olmo2ForCausalLM")
    g = torch.Generator().manual_seed(5)

    def edit(name, t):
        if re.search(r"self_attn\.[qk]_norm\.weight$", name):
            return t * (0.2 + 2.0 * torch.rand(t.shape, generator=g))
        return None
    _arm(base, _edit_tensors(base, tmp_path / "olmo2_qk", edit), "perturbing q_norm / k_norm")


def test_post_norm_weights_matter(tiny_checkpoint, tmp_path):
    """OLMo 2's post-norm (the only norm of its steps): scaling post_feedforward_layernorm changes the tokens."""
    base = tiny_checkpoint("Olmo2ForCausalLM")
    g = torch.Generator().manual_seed(6)

    def edit(name, t):
        if name.endswith("post_feedforward_layernorm.weight"):
            return t * (0.2 + 2.0 * torch.rand(t.shape, generator=g))
        return None
    _arm(base, _edit_tensors(base, tmp_path / "olmo2_post", edit), "perturbing post_feedforward_layernorm")


@pytest.mark.parametrize("arch", ["OlmoeForCausalLM", "OlmoForCausalLM"])
def test_clip_qkv_value_matters(arch, tiny_checkpoint):
    """clip_qkv 1.0 (the tiny default), 2.0 and null (off) give three different outputs; each is transformers'."""
    base = tiny_checkpoint(arch)                      # clip_qkv 1.0 (tests/fixtures/tiny_hf.py ARCH_DEFAULTS)
    wide = tiny_checkpoint(arch, overrides={"clip_qkv": 2.0})
    off = tiny_checkpoint(arch, overrides={"clip_qkv": None})
    outs = {c: _hf(p) for c, p in (("1.0", base), ("2.0", wide), ("off", off))}
    assert len({str(v) for v in outs.values()}) == 3, "clip_qkv does not change transformers' output"
    for c, p in (("2.0", wide), ("off", off)):
        assert _engine(p) == outs[c], f"clip_qkv {c}: engine != transformers"


def test_olmoe_renormalized_routing_matters(tiny_checkpoint):
    """OLMoE routes with the top-k softmax probabilities as they are (norm_topk_prob false, its default);
    norm_topk_prob true renormalizes them: a different output in transformers, served alike."""
    base = tiny_checkpoint("OlmoeForCausalLM")
    renorm = tiny_checkpoint("OlmoeForCausalLM", overrides={"norm_topk_prob": True})
    want = _hf(renorm)
    assert want != _hf(base)
    assert _engine(renorm) == want


# -------------------------------------------------------------------------------------------- dataflow by flag
def _readme_example(name: str) -> str:
    text = (REPO / "codegen" / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"<!-- spec: {re.escape(name)} -->\n```yaml\n(.*?)\n```", text, re.S)
    assert m, f"codegen/README.md has no example {name}"
    return m.group(1) + "\n"


def test_dataflow_by_config_flag(tiny_checkpoint):
    """specs/stablelm.yaml serves StableLM with use_parallel_residual false (sequential: two norms) and true
    (parallel: one shared norm, no post_attention_layernorm in the checkpoint), with its default partial rotary;
    the forms differ in transformers and the engine matches each."""
    source = (REPO / "generated" / "stablelm" / "model.py").read_text()
    assert "class StableLmParallelDecoderLayer(StableLmDecoderLayer):" in source
    full = {"use_qkv_bias": True}
    seq = tiny_checkpoint("StableLmForCausalLM", overrides={**full, "use_parallel_residual": False})
    par = tiny_checkpoint("StableLmForCausalLM", overrides={**full, "use_parallel_residual": True})
    want_seq, want_par = _hf(seq), _hf(par)
    assert want_seq != want_par
    assert _engine(seq) == want_seq
    assert _engine(par) == want_par


# -------------------------------------------------------------------------------------------- TP
@pytest.mark.slow
def test_projection_k_norm_with_replicated_kv_heads_at_tp2(tiny_checkpoint):
    """OLMo 2 with one KV head at TP 2: each rank holds the replicated k projection and its k_norm weight."""
    ckpt = tiny_checkpoint("Olmo2ForCausalLM", overrides={"num_key_value_heads": 1})
    assert _engine(ckpt, tp=2) == _hf(ckpt)


# -------------------------------------------------------------------------------------------- compile errors
def _compile_error(tmp_path, text: str) -> str:
    from xllm_gen.codegen.cli import main as cli_main

    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    for spec in (REPO / "specs").glob("*.yaml"):
        shutil.copy(spec, specs / spec.name)
    (specs / "x.yaml").write_text(text, encoding="utf-8")
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(["--dry-run", str(specs / "x.yaml")]) != 0
    return err.getvalue()


HEAD = "extends: llama.yaml\nname: x\nclass_prefix: X\narchitectures: [XForCausalLM]\n" \
       "variants: {Llama-3.2-1B: ~, Llama-3.1-8B: ~}\n"


def test_parallel_and_when_errors_are_located(tmp_path):
    """A parallel branch may read the stream itself (no `norm`), but takes no `when`; a parallel step's `post_norm`
    names a norm; a step's `when` may gate a per-layer choice (Nemotron-NAS: attention, a linear or nothing), whose
    alternatives must exist: each a located error naming the key."""
    par = "    dataflow:\n      - parallel: [{block: self_attn%s}, {norm: input_layernorm, block: mlp}]%s\n"
    blocks = "decoder:\n  layers:\n    blocks:\n      post_attention_layernorm: ~\n"
    err = _compile_error(tmp_path, HEAD + blocks + par % (", when: 'True'", ""))
    assert "x.yaml:" in err and "parallel[0].when: not supported in a parallel step" in err
    err = _compile_error(tmp_path, HEAD + blocks + "    dataflow:\n      - post_norm: mlp\n        parallel: "
                                                   "[{block: self_attn}, {norm: input_layernorm, block: mlp}]\n")
    assert "x.yaml:" in err and "post_norm: block 'mlp' is" in err
    err = _compile_error(tmp_path, HEAD + "decoder:\n  layers:\n    dataflow:\n"
                                          "      - {norm: input_layernorm, block: self_attn}\n"
                                          "      - {norm: post_attention_layernorm, block: {if: 'layer > 0', then: mlp,"
                                          " else: mlp2}, when: 'True'}\n")
    assert "x.yaml:" in err and "dataflow[1].block.else: no block 'mlp2'" in err      # a `when` may gate a choice now
    from xllm_gen.codegen.cli import main as cli_main
    (tmp_path / "specs" / "x.yaml").write_text(
        HEAD + "decoder:\n  layers:\n    blocks:\n      mlp2: {kind: gated_mlp, hidden: hidden_size, intermediate: "
        "intermediate_size, activation: hidden_act, gate_up: {name: gate_up_proj, segments: [gate, up]}, down: "
        "{name: down_proj}}\n    dataflow:\n      - {norm: input_layernorm, block: self_attn}\n"
        "      - {norm: post_attention_layernorm, block: {if: 'layer > 0', then: mlp, else: mlp2, name: mlp}, "
        "when: 'True'}\n", encoding="utf-8")
    assert cli_main(["--dry-run", str(tmp_path / "specs" / "x.yaml")]) == 0       # a `when` on a per-layer choice
    (tmp_path / "specs" / "x.yaml").write_text(HEAD + blocks + par % ("", ""), encoding="utf-8")
    assert cli_main(["--dry-run", str(tmp_path / "specs" / "x.yaml")]) == 0      # a branch without norm compiles


def test_dataflow_if_may_read_layer(tmp_path):
    """A dataflow chosen per layer (`if` reading `layer`: each layer built with its own dataflow, LFM3's sandwich
    norms, OLMo-Hybrid's post-norm attention layers) compiles; a block only the other dataflow uses is still refused
    where the condition names an unknown symbol."""
    from xllm_gen.codegen.cli import main as cli_main
    flows = ("      then: [{norm: input_layernorm, block: self_attn}, {norm: post_attention_layernorm, block: mlp}]\n"
             "      else: [{block: self_attn}, {norm: post_attention_layernorm, block: mlp}]\n")
    _compile_error(tmp_path, HEAD + "decoder:\n  layers:\n    dataflow:\n      if: \"layerz > 0\"\n" + flows)
    (tmp_path / "specs" / "x.yaml").write_text(HEAD + "decoder:\n  layers:\n    dataflow:\n      if: \"layer > 0\"\n"
                                               + flows, encoding="utf-8")
    assert cli_main(["--dry-run", str(tmp_path / "specs" / "x.yaml")]) == 0


def test_weightless_norm_with_offset_is_refused(tmp_path):
    err = _compile_error(tmp_path, HEAD + "decoder:\n  norm: {kind: layernorm, eps: 1.0e-5, weight: false, "
                                          "weight_offset: 1}\n")
    assert "x.yaml:" in err and "weight_offset" in err


# -------------------------------------------------------------------------------------------- q/k norm forms
class _AfterRotary(torch.nn.LayerNorm):
    """A LayerNorm that HF's q_norm / k_norm slot skips (identity); the patched rotary applies it afterwards."""

    def forward(self, x):
        return x

    def norm(self, x):
        return super().forward(x)


class _ProjectionAfterRotary(torch.nn.Module):
    """An RMSNorm over all heads jointly ([heads * head_dim] weight) that HF's q_norm / k_norm slot skips; the
    patched rotary applies it to the rotated [batch, heads, seq, head_dim] tensor."""

    def __init__(self, heads, head_dim, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(heads * head_dim)), eps

    def forward(self, x):
        return x

    def norm(self, x):
        b, h, s, d = x.shape
        xf = x.transpose(1, 2).reshape(b, s, h * d).float()
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y.view(b, s, h, d).transpose(1, 2)


class _BiasedRMSNorm(torch.nn.Module):
    """HF's RMSNorm math (float32 variance, `weight * x.to(dtype)`) plus a learned bias."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.bias, self.eps = torch.nn.Parameter(torch.ones(dim)), torch.nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) + self.bias


def _qk_variant(tmp_path, tiny_checkpoint, monkeypatch, form: str, qk_norm_yaml: str, make_norm, after_rotary=False,
               tp: int = 1, config_extra: dict | None = None, spec_config: str = ""):
    """HF Qwen3 with its q_norm / k_norm replaced by `make_norm(heads)` modules (random weights and biases), as
    a checkpoint of a renamed architecture, served by a spec that extends qwen3.yaml with `qk_norm_yaml`.
    Returns (engine tokens, HF tokens, HF tokens of the unmodified model)."""
    import transformers.models.qwen3.modeling_qwen3 as mq
    from hf_ref import _generate
    from transformers import Qwen3ForCausalLM

    from xllm_gen.codegen.cli import main as cli_main

    base = tiny_checkpoint("Qwen3ForCausalLM")
    model = Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    g = torch.Generator().manual_seed(11)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = make_norm(cfg.num_attention_heads), make_norm(cfg.num_key_value_heads)
        for p in list(attn.q_norm.parameters()) + list(attn.k_norm.parameters()):
            with torch.no_grad():
                p.copy_(0.5 + torch.rand(p.shape, generator=g) if p.dim() and p is not getattr(
                    attn.q_norm, "bias", None) and p is not getattr(attn.k_norm, "bias", None)
                    else 0.3 * torch.randn(p.shape, generator=g))
    if after_rotary:
        rotate = mq.apply_rotary_pos_emb
        current = {}

        def rotate_then_norm(q, k, cos, sin, *args, **kwargs):
            q, k = rotate(q, k, cos, sin, *args, **kwargs)
            return current["attn"].q_norm.norm(q), current["attn"].k_norm.norm(k)
        monkeypatch.setattr(mq, "apply_rotary_pos_emb", rotate_then_norm)
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda m, *a: current.__setitem__("attn", m))

    def greedy(m):
        out = []
        for p in _prompts():
            ids = torch.tensor([p])
            out.append(_generate(m, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, MAX_TOKENS, len(p)))
        return out
    want = greedy(model)
    arm = tmp_path / "ckpt"
    model.save_pretrained(arm)
    for f in base.iterdir():
        if f.is_file() and not (arm / f.name).exists():
            shutil.copy(f, arm / f.name)
    import json
    c = json.loads((arm / "config.json").read_text())
    camel = "".join(w.title() for w in form.split("_"))    # one generated package per form (imports are cached)
    c["architectures"] = [f"Qk{camel}ForCausalLM"]
    c.update(config_extra or {})
    (arm / "config.json").write_text(json.dumps(c))

    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(REPO / "specs" / "qwen3.yaml", specs / "qwen3.yaml")
    (specs / "qk_variant.yaml").write_text(
        f"extends: qwen3.yaml\nname: qk_{form}\nclass_prefix: Qk{camel}\narchitectures: [Qk{camel}ForCausalLM]\n"
        + (f"config:\n  {spec_config}\n" if spec_config else "") +
        f"decoder:\n  layers:\n    blocks:\n      self_attn:\n        qk_norm: {qk_norm_yaml}\n"
        "variants: {Qwen3-0.6B: ~, Qwen3-8B: ~, Qwen3-32B: ~}\n", encoding="utf-8")
    assert cli_main([str(specs / "qk_variant.yaml"), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    return _engine(arm, tp), want, _hf(base)


QK_FORMS = {
    # LayerNorm per head with a shared [head_dim] weight and a bias
    "layernorm_bias": ("{kind: layernorm, eps: rms_norm_eps, bias: true}",
                       lambda heads: torch.nn.LayerNorm(16, eps=1e-6), False),
    # Gemma 3's (1 + w) RMSNorm on q and k
    "rmsnorm_offset": ("{kind: rmsnorm, eps: rms_norm_eps, weight_offset: 1}",
                       lambda heads: __import__("transformers").models.gemma3.modeling_gemma3.Gemma3RMSNorm(16, eps=1e-6),
                       False),
    # RMSNorm with a bias (the fused CUDA q/k norm + rotary kernel has none: the unfused path runs)
    "rmsnorm_bias": ("{kind: rmsnorm, eps: rms_norm_eps, bias: true}", lambda heads: _BiasedRMSNorm(16, 1e-6), False),
    # Cohere's LayerNorm per head with a weight per head [heads, head_dim]
    "layernorm_per_head": ("{kind: layernorm, eps: rms_norm_eps, weights: per_head}",
                           lambda heads: __import__("transformers").models.cohere.modeling_cohere.CohereLayerNorm(
                               (heads, 16), eps=1e-6), False),
    # LayerNorm per head after rotary
    "layernorm_after_rotary": ("{kind: layernorm, eps: rms_norm_eps, bias: true, at: after_rotary}",
                               lambda heads: _AfterRotary(16, eps=1e-6), True),
    # RMSNorm over the whole projection, after rotary
    "projection_after_rotary": ("{kind: rmsnorm, eps: rms_norm_eps, over: projection, at: after_rotary}",
                                lambda heads: _ProjectionAfterRotary(heads, 16, 1e-6), True),
}


# the default arm: the forms no shipped family covers; Gemma 3's (1 + w) q/k norm is in the conformance battery
@pytest.mark.parametrize("form", [pytest.param(f, marks=pytest.mark.slow) if f == "rmsnorm_offset" else f
                                  for f in QK_FORMS])
def test_qk_norm_forms_match_transformers(form, tmp_path, tiny_checkpoint, monkeypatch):
    """Each q/k norm form, written into HF Qwen3's q_norm / k_norm slots (the after-rotary one by moving the
    norm behind HF's rotary), changes HF's tokens, and the spec with that `qk_norm` serves HF's tokens."""
    yaml_form, make_norm, after = QK_FORMS[form]
    got, want, plain = _qk_variant(tmp_path, tiny_checkpoint, monkeypatch, form, yaml_form, make_norm, after)
    assert want != plain, f"{form}: the q/k norm form does not change transformers' output"
    assert got == want, f"{form}: engine != transformers"


@pytest.mark.slow
@pytest.mark.parametrize("form", ["layernorm_per_head", "rmsnorm_offset", "projection_after_rotary"])
def test_qk_norm_forms_at_tp2(form, tmp_path, tiny_checkpoint, monkeypatch):
    """At TP 2 the per-head weights [heads, head_dim] are split by heads like the q / k projection."""
    yaml_form, make_norm, after = QK_FORMS[form]
    got, want, _ = _qk_variant(tmp_path, tiny_checkpoint, monkeypatch, form, yaml_form, make_norm, after, tp=2)
    assert got == want, f"{form} at TP 2: engine != transformers"


@pytest.mark.parametrize("on", [True, False], ids=["use_qk_norm", "no_qk_norm"])
def test_qk_norm_enabled_by_config_flag(on, tmp_path, tiny_checkpoint, monkeypatch):
    """`qk_norm: {enabled: use_qk_norm}`: one spec serves checkpoints with q/k norms (the flag true) and without
    (false: no q_norm / k_norm tensors); transformers' outputs differ, the engine matches each."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    make = (lambda heads: Qwen3RMSNorm(16, eps=1e-6)) if on else (lambda heads: torch.nn.Identity())
    got, want, plain = _qk_variant(tmp_path, tiny_checkpoint, monkeypatch, "flag_on" if on else "flag_off",
                                   "{enabled: use_qk_norm}", make, config_extra={"use_qk_norm": on},
                                   spec_config="use_qk_norm: {type: bool, from: use_qk_norm, default: true}")
    assert want != plain
    assert got == want, f"use_qk_norm={on}: engine != transformers"
