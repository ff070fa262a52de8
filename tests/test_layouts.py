"""Checkpoint row layouts (runtime/loading/layout.py) and the activation table (runtime/layers/activation.py).

- A fused q|k|v tensor stored per head (GPT-NeoX), per KV group (Falcon new_decoder_architecture) or multi-query,
  loaded through its RowLayout at TP 1, 2 and 4 (KV replication), equals the reference split of the same tensor
  the way transformers splits it; the wrong layout does not; each rank reads only the span of groups it holds.
- Every activation the runtime table names equals transformers' ACT2FN of that name, plain and gated.
"""
from __future__ import annotations

import pytest
import torch

from xllm_gen.runtime import layers as L
from xllm_gen.runtime.executor import distributed as D
from xllm_gen.runtime.executor.sharding import WeightLoadError
from xllm_gen.runtime.loading.layout import RowLayout


def _hf_split(fused: torch.Tensor, heads: int, kv: int, hd: int, how: str):
    """q [heads*hd, X], k, v [kv*hd, X] from a fused tensor, split exactly as transformers does (on the output
    rows): GPT-NeoX `view(heads, 3*hd).chunk(3)`, Falcon `view(kv, heads/kv + 2, hd)`, multi-query `view(heads + 2, hd)`."""
    rest = fused.shape[1:]
    if how == "head":
        t = fused.view(heads, 3 * hd, *rest)
        q, k, v = t.chunk(3, dim=1)
        return q.reshape(heads * hd, *rest), k.reshape(heads * hd, *rest), v.reshape(heads * hd, *rest)
    t = fused.view(kv, heads // kv + 2, hd, *rest)
    return (t[:, :-2].reshape(heads * hd, *rest), t[:, -2].reshape(kv * hd, *rest), t[:, -1].reshape(kv * hd, *rest))


class CountingSlice:
    """A tensor that records the rows each read touches (as a lazy safetensors slice would read them)."""

    def __init__(self, t):
        self.t, self.read = t, 0

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, idx):
        out = self.t[idx]
        self.read += out.shape[0]
        return out


CASES = [  # (layout per, heads, kv_heads): NeoX per head, Falcon-40B per group, Falcon-7B multi-query
    ("head", 4, 4), ("kv_group", 4, 2), ("kv_group", 8, 2), ("kv_group", 4, 1)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("per,heads,kv", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_layout_loads_reference_split(per, heads, kv, tp, bias):
    hd, hidden = 3, 5
    torch.manual_seed(0)
    rows = (heads + 2 * kv) * hd
    fused = torch.randn(rows, hidden) if not bias else torch.randn(rows)
    q, k, v = _hf_split(fused, heads, kv, hd, per if per == "head" else "group")
    layout = RowLayout(per, ("q", "k", "v"))
    full = torch.cat([q, k, v])
    for rank in range(tp):
        D.init_tp(rank, tp)
        try:
            layer = L.QKVParallelLinear(hidden, hd, heads, kv, bias=bias)
        finally:
            D.reset_tp()
        param = layer.bias if bias else layer.weight
        src = CountingSlice(fused)
        param.weight_loader(param, layout.view(src, param.tp_split.segments))
        # the reference: this rank's rows of the blocked [q | k | v], as the blocked tensor itself loads
        ref = torch.empty_like(param)
        param.tp_split.load(ref, full)
        assert torch.equal(param.data, ref), (per, heads, kv, tp, rank)
        # each rank reads the groups it holds (once for q, k and v), not the whole tensor
        groups = kv if per == "kv_group" else heads
        assert src.read <= rows // min(tp, groups), (src.read, rows)
        # the same tensor taken as blocked [q | k | v] is a different model (the sensitivity of the layout)
        if not (per == "kv_group" and kv == 1):          # multi-query: per group with one group IS blocked
            wrong = torch.empty_like(param)
            param.tp_split.load(wrong, fused)
            assert not torch.equal(wrong, ref)


def test_layout_blocked_reorder_and_gate_up_interleave():
    """`per: tensor` with another order ([k, v, q] stored) and `per: head` over gate | up rows (interleaved rows)."""
    torch.manual_seed(1)
    hd, heads, kv, hidden = 2, 4, 2, 3
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    layer = L.QKVParallelLinear(hidden, hd, heads, kv)
    layer.weight.weight_loader(layer.weight, RowLayout("tensor", ("k", "v", "q")).view(torch.cat([k, v, q]),
                                                                                        layer.weight.tp_split.segments))
    assert torch.equal(layer.weight.data, torch.cat([q, k, v]))
    D.init_tp(1, 2)
    try:
        layer = L.QKVParallelLinear(hidden, hd, heads, kv)
    finally:
        D.reset_tp()
    src = CountingSlice(torch.cat([k, v, q]))
    layer.weight.weight_loader(layer.weight, RowLayout("tensor", ("k", "v", "q")).view(src, layer.weight.tp_split.segments))
    half = lambda t: t[t.shape[0] // 2:]                                      # noqa: E731 - rank 1 of 2
    assert torch.equal(layer.weight.data, torch.cat([half(q), half(k), half(v)]))
    assert src.read == (heads + 2 * kv) * hd // 2                             # only the rank's rows
    inter = 5
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    stored = torch.stack([gate, up], dim=1).reshape(2 * inter, hidden)        # g0 u0 g1 u1 ...
    for tp in (1,):
        mlp = L.MergedColumnParallelLinear(hidden, [inter, inter], segment_names=("gate", "up"))
        w = mlp.weight
        w.weight_loader(w, RowLayout("head", ("gate", "up")).view(stored, w.tp_split.segments))
        assert torch.equal(w.data, torch.cat([gate, up]))


def test_layout_errors_are_named():
    layer = L.QKVParallelLinear(4, 2, 4, 2)
    segs = layer.weight.tp_split.segments
    with pytest.raises(WeightLoadError, match="per: head needs segments of equal heads"):
        RowLayout("head", ("q", "k", "v")).view(torch.zeros(16, 4), segs)
    with pytest.raises(WeightLoadError, match="cannot hold the segments"):
        RowLayout("kv_group", ("q", "k", "v")).view(torch.zeros(18, 4), segs)
    with pytest.raises(WeightLoadError, match="must name the parameter's segments"):
        RowLayout("kv_group", ("q", "k")).view(torch.zeros(16, 4), segs)
    with pytest.raises(ValueError, match="per must be one of"):
        RowLayout("row", ("q", "k", "v"))


# ------------------------------------------------------------------------------------------------ activations
def test_activations_match_act2fn():
    """Each name of the runtime's table is transformers' ACT2FN of that name (looked up there, not copied)."""
    from transformers.activations import ACT2FN

    from xllm_gen.runtime.layers.activation import ACTIVATIONS, GATED_ACTIVATIONS

    torch.manual_seed(0)
    x = torch.randn(7, 64) * 4
    from xllm_gen.codegen import resolver_blocks

    assert set(GATED_ACTIVATIONS) == set(ACTIVATIONS) == set(resolver_blocks.ACTIVATIONS)   # what specs may name
    assert set(resolver_blocks.GATED_ACTIVATIONS) <= set(ACTIVATIONS)                      # moe experts (fused)
    for name in ACTIVATIONS:
        ref = ACT2FN[name]
        torch.testing.assert_close(L.act(name)(x), ref(x), rtol=0, atol=1e-6, msg=name)
        gate, up = x[:, :32], x[:, 32:]
        torch.testing.assert_close(L.gated_act(name)(x), ref(gate) * up, rtol=0, atol=1e-5, msg=name)
    for name in ("relu2", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "silu", "swish", "relu",
                 "gelu", "tanh", "sigmoid", "mish"):
        assert name in ACTIVATIONS
    with pytest.raises(ValueError, match="unsupported activation 'nope'"):
        L.act("nope")


# ------------------------------------------------------------------------ specs: parity arms of the primitives
from test_spec_battery import Tokens, _assert_same  # noqa: E402  (the battery's HF / engine runner)

_TOKENS = Tokens()


def _flat(tokens) -> bool:
    return all(len(set(t)) <= 2 for t in tokens)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_falcon_multi_query_matches_hf(tiny_checkpoint, tp):
    """num_kv_heads 1 (multi-query): the per-KV-group qkv is one group [q * heads, k, v]; at TP 2 both ranks hold
    the one KV head (replication)."""
    ckpt = tiny_checkpoint("FalconForCausalLM", overrides={"num_kv_heads": 1})
    want = _TOKENS.hf(ckpt)
    assert not _flat(want)
    _assert_same(_TOKENS.engine(ckpt, tp), want, f"falcon multi-query tp={tp}")


@pytest.mark.parametrize("arch, overrides", [
    ("FalconForCausalLM", {"bias": True}),                  # biases on qkv (per KV group), dense and the MLP
    ("GPTNeoXForCausalLM", {"attention_bias": False}),      # no q/k/v/o biases, MLP biases kept
    ("FalconForCausalLM", {"activation": "relu"}),          # another activation of the table
    ("GPTNeoXForCausalLM", {"hidden_act": "relu"}),
    ("GPTNeoXForCausalLM", {"use_parallel_residual": False}),
    # Falcon-7B's form (one shared norm, multi-query), and without multi_query (one group per head); the
    # released config has no num_kv_heads (transformers: num_attention_heads)
    ("FalconForCausalLM", {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": 4}),
    ("FalconForCausalLM", {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4}),
    ("GPTNeoXForCausalLM", {"rope_parameters": {"partial_rotary_factor": 1.0}}),   # full rotary vs the tiny 0.5
])
def test_biases_and_activations_match_hf(tiny_checkpoint, arch, overrides):
    ckpt = tiny_checkpoint(arch, overrides=overrides)
    base = tiny_checkpoint(arch)
    want = _TOKENS.hf(ckpt)
    assert want != _TOKENS.hf(base), f"{arch} {overrides}: the feature does not change transformers' output"
    _assert_same(_TOKENS.engine(ckpt), want, f"{arch} {overrides}")


@pytest.mark.parametrize("arch, module, overrides", [
    ("GPTNeoXForCausalLM", "gpt_neox", None),
    ("FalconForCausalLM", "falcon", {"bias": True}),
])
def test_wrong_layout_breaks_parity(tiny_checkpoint, monkeypatch, arch, module, overrides):
    """The sensitivity arm: the same checkpoint read as blocked [q | k | v] (the layout dropped) serves another model."""
    import importlib

    ckpt = tiny_checkpoint(arch, overrides=overrides)
    want = _TOKENS.hf(ckpt)
    _assert_same(_TOKENS.engine(ckpt), want, f"{arch} with its layout")
    mod = importlib.import_module(f"xllm_gen.generated.{module}.model")
    assert mod.WEIGHT_LAYOUTS
    monkeypatch.setattr(mod, "WEIGHT_LAYOUTS", {})
    from test_spec_battery import BLOCK_SIZE, MAX_TOKENS, _requests

    from xllm_gen import LLM, SamplingParams

    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=BLOCK_SIZE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            _requests(ckpt), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got != want, f"{arch}: reading the fused qkv as blocked does not change the output"


def test_falcon_rw_forms_are_read_and_new_decoder_sequential_refused_by_name():
    """(hP) ALiBi and the sequential blocks (Falcon-RW) are modelled now (tests/test_released_settings_hP.py); a
    sequential new-decoder file, which transformers' Falcon cannot run, is refused by name."""
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry
    from xllm_gen.runtime.loading.hf_config import ConfigError

    cfg = {**tiny_config("FalconForCausalLM").to_dict(), "new_decoder_architecture": False, "alibi": True,
           "parallel_attn": False}
    module, _ = registry.resolve(cfg)
    c = module.Config.from_hf(cfg)
    assert (c.alibi, c.parallel_attn) == (True, False)
    with pytest.raises(ConfigError, match="specs/falcon.yaml.*sequential_old_decoder"):
        module.Config.from_hf({**cfg, "new_decoder_architecture": True})


def test_gpt_neox_absent_rotary_pct_is_transformers_default():
    """transformers' default rotary_pct is 0.25: a checkpoint without the field is served with that fraction."""
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("GPTNeoXForCausalLM").to_dict()
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).rotary_pct == 0.5
    del cfg["rope_parameters"]["partial_rotary_factor"]
    assert module.Config.from_hf(cfg).rotary_pct == 0.25


# ------------------------------------------------------------------------------------------ compile errors
_QKV = "model.layers.{i}.self_attention.query_key_value"


@pytest.mark.parametrize("body, match", [
    (f"weights:\n  {_QKV}.weight:\n    from: x.{{i}}.qkv\n    layout: {{interleave: [q, k, x], per: kv_group}}\n",
     r"child\.yaml:\d+:\d+: .*layout\.interleave: must name each of the parameter's segments \['q', 'k', 'v'\] once"),
    (f"weights:\n  {_QKV}.weight:\n    from: x.{{i}}.qkv\n    layout: {{interleave: [q, k, v], per: row}}\n",
     r"child\.yaml:\d+:\d+: .*per"),
    ("weights:\n  model.layers.{i}.self_attention.dense.weight:\n    from: x.{i}.dense\n"
     "    layout: {interleave: [q, k, v], per: head}\n",
     r"child\.yaml:\d+:\d+: .*layout: only a fused column-parallel parameter"),
    (f"weights:\n  {_QKV}.weight:\n    from: x.{{i}}.qkv\n    layout: {{interleave: [q, k, v], per: head}}\n"
     f"  {_QKV}.bias:\n    from: x.{{i}}.qkv_bias\n    layout: {{interleave: [q, k, v], per: head}}\n",
     r"child\.yaml:\d+:\d+: error: variants\.falcon-40b: .*layout per: head needs every segment to have as many "
     r"heads, got q: 128, k: 8, v: 8"),
    (f"weights:\n  {_QKV}.weight:\n    from: {{q: 'a.{{i}}.q', k: 'a.{{i}}.k', v: 'a.{{i}}.v'}}\n"
     f"    layout: {{interleave: [q, k, v], per: head}}\n",
     r"child\.yaml:\d+:\d+: .*a layout describes one fused checkpoint tensor"),
    ("checkpoint_prefixes:\n  model.layer.: transformer.h.\n",
     r"child\.yaml:\d+:\d+: .*checkpoint_prefixes: no parameter name starts with 'model\.layer\.'"),
])
def test_layout_compile_errors_are_located(tmp_path, body, match):
    from pathlib import Path

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors

    spec = Path(__file__).resolve().parents[1] / "specs" / "falcon.yaml"
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {spec}\nname: layout_child\n" + body)
    with pytest.raises((SpecError, SpecErrors), match=match):
        compile_spec(child)


def test_a_fused_bias_takes_its_weights_layout(tmp_path):
    """A fused bias read from one tensor without a layout of its own takes its weight's (GPTBigCode's c_attn: read
    blocked, it was right only for multi-query checkpoints, where the two orders coincide); a different one is a
    located error."""
    from pathlib import Path

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors
    specs = Path(__file__).resolve().parent.parent / "specs"
    text = (specs / "gpt_bigcode.yaml").read_text().replace("extends: gpt2.yaml", f"extends: {specs / 'gpt2.yaml'}")
    bias = ('    from: "transformer.h.{i}.attn.c_attn.bias"\n'
            '    layout: {interleave: [q, k, v], per: kv_group}\n')
    assert bias in text
    (tmp_path / "inherit.yaml").write_text(text.replace(bias, '    from: "transformer.h.{i}.attn.c_attn.bias"\n'))
    weights = {w.param.name: w for w in compile_spec(tmp_path / "inherit.yaml").ir.weights}
    b, w = (next(v for n, v in weights.items() if n.endswith(f"attn.c_attn.{k}")) for k in ("bias", "weight"))
    assert w.layout is not None and b.layout == w.layout
    (tmp_path / "other.yaml").write_text(text.replace(bias, bias.replace("per: kv_group", "per: head")))
    with pytest.raises((SpecError, SpecErrors), match=r"layout: the bias's rows are laid out as its weight's"):
        compile_spec(tmp_path / "other.yaml")


# ------------------------------------------------------------------------------ a layout chosen by a config flag
_GLM = "model.layers.{i}.self_attention.query_key_value"
# a released-shape variant without multi-query attention (k and v of every head: the `else` branch, per head)
_GLM_NO_MQA = ("variants:\n  no-mqa: {hidden_size: 4096, intermediate_size: 13696, num_hidden_layers: 28, "
               "num_attention_heads: 32, head_dim: 128, multi_query_attention: false, vocab_size: 65024}\n")


def _glm_child(tmp_path, body: str):
    from pathlib import Path

    spec = Path(__file__).resolve().parents[1] / "specs" / "chatglm.yaml"
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {spec}\nname: glm_child\n" + body)
    return child


def test_a_layout_chosen_by_a_flag_compiles_and_renders(tmp_path):
    """`layout: {if: flag, then: A, else: B}` (specs/chatglm.yaml: blocked with multi_query_attention, per head
    without): both branches resolved (the blocked one as None: nothing to undo), the bias inheriting the choice,
    a variant of each branch checked, and the generated module listing a RowLayoutChoice of the flag."""
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.ir import LayoutChoice

    compiled = compile_spec(_glm_child(tmp_path, _GLM_NO_MQA))
    weights = {w.param.name: w for w in compiled.ir.weights}
    w, b = (weights[f"{compiled.ir.decoder_prefix}{_GLM[len('model'):]}.{k}"] for k in ("weight", "bias"))
    assert isinstance(w.layout, LayoutChoice) and b.layout == w.layout
    assert (str(w.layout.cond), w.layout.then, w.layout.else_) == ("multi_query_attention", None,
                                                                    ("head", ("q", "k", "v")))
    assert {v.name for v in compiled.ir.variants} >= {"chatglm3-6b", "no-mqa"}
    model = compiled.module()
    choice = model.WEIGHT_LAYOUTS[f"{_GLM}.weight"]
    assert choice.cond_text == "multi_query_attention" and choice.then is None
    assert choice.else_ == model.RowLayout("head", ("q", "k", "v"))


@pytest.mark.parametrize("body, match", [
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      else: {{interleave: [q, k, x]}}\n",
     r"child\.yaml:\d+:\d+: .*layout\.else\.interleave: must name each of the parameter's segments "
     r"\['q', 'k', 'v'\] once, got \['q', 'k', 'x'\]"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      then: {{per: group}}\n",
     r"child\.yaml:\d+:\d+: .*layout\.then: `groups` \(the number of groups\) goes with `per: group`"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      if: \"layer < 2\"\n",
     r"child\.yaml:\d+:\d+: .*`layer` \(the layer index\) is only defined"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      if: multi_query_atention\n",
     r"child\.yaml:\d+:\d+: .*unknown config symbol 'multi_query_atention'.*multi_query_attention"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      if: rope_ratio\n",
     r"child\.yaml:\d+:\d+: .*rope_ratio"),
    # the branch a variant's flag chooses must fit its heads (the multi-query releases, k and v of 2 heads)
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      then: {{per: head}}\n",
     r"child\.yaml:\d+:\d+: error: variants\.chatglm3-6b: .*layout\.then per: head needs every segment to have as "
     r"many heads, got q: 32, k: 2, v: 2 \(chosen: multi_query_attention is True\)"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      if: \"multi_query_group_num * 1\"\n",
     r"child\.yaml:\d+:\d+: error: variants\.chatglm3-6b: .*layout\.if gives 2, not a bool"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      else: ~\n",
     r"child\.yaml:\d+:\d+: .*layout: missing required key 'else'"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      per: head\n",
     r"child\.yaml:\d+:\d+: .*layout: unknown key 'per' \(allowed: if, then, else\)"),
    (f"weights:\n  {_GLM}.weight:\n    layout:\n      then: {{per: heads}}\n",
     r"child\.yaml:\d+:\d+: .*layout\.then\.per: 'heads' \(str\) is not allowed \(did you mean 'head'\?\)"),
])
def test_a_layout_choice_errors_are_located(tmp_path, body, match):
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors

    with pytest.raises((SpecError, SpecErrors), match=match):
        compile_spec(_glm_child(tmp_path, body))


# ------------------------------------------------------- a fused parameter filled from several tensors (k+v of one)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("per", ["head", "blocked"])
def test_segments_of_one_tensor_load_per_rank(tp, per):
    """q from its own tensor, k and v from one `key_value` ([kv0: k v, kv1: k v]: TeleChat2; or blocked [k | v]) read
    through a FusedSource: each rank's q / k / v rows equal the blocked [q | k | v]'s (KV heads replicated at TP 4),
    and a rank reads only its KV heads' rows of key_value, once for k and v together."""
    from xllm_gen.runtime.loading.layout import FusedSource
    hd, heads, kv, hidden = 3, 4, 2, 5
    torch.manual_seed(2)
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    if per == "head":
        key_value = torch.stack([k.view(kv, hd, hidden), v.view(kv, hd, hidden)], 1).reshape(2 * kv * hd, hidden)
        fused = FusedSource(("k", "v"), RowLayout("head", ("k", "v")))
    else:
        key_value, fused = torch.cat([k, v]), FusedSource(("k", "v"))
    full = torch.cat([q, k, v])
    for rank in range(tp):
        D.init_tp(rank, tp)
        try:
            layer = L.QKVParallelLinear(hidden, hd, heads, kv)
        finally:
            D.reset_tp()
        w = layer.weight
        src = CountingSlice(key_value)
        view = fused.view(src, w.tp_split.segments)
        w.weight_loader(w, q, "q")
        for seg in ("k", "v"):
            w.weight_loader(w, fused.segment_view(view, seg), seg)
        ref = torch.empty_like(w)
        w.tp_split.load(ref, full)
        assert torch.equal(w.data, ref), (per, tp, rank)
        if per == "head":       # the rank's KV heads' [k v] groups, one read for both
            assert src.read == 2 * kv * hd // min(tp, kv), (src.read, tp)
    if per == "head":           # the same tensor read blocked is another model
        layer = L.QKVParallelLinear(hidden, hd, heads, kv)
        w = layer.weight
        view = FusedSource(("k", "v")).view(key_value, w.tp_split.segments)
        w.weight_loader(w, q, "q")
        for seg in ("k", "v"):
            w.weight_loader(w, FusedSource(("k", "v")).segment_view(view, seg), seg)
        assert not torch.equal(w.data, full)


def test_segments_of_one_tensor_stored_transposed():
    """An entry's `transpose` (TensorLayout) applies to a FusedSource's tensor too: the key_value stored [in, out]."""
    from xllm_gen.runtime.loading.layout import FusedSource
    from xllm_gen.runtime.loading.weights import TensorLayout
    hd, heads, kv, hidden = 2, 4, 2, 3
    torch.manual_seed(3)
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    key_value = torch.stack([k.view(kv, hd, hidden), v.view(kv, hd, hidden)], 1).reshape(2 * kv * hd, hidden)
    fused = FusedSource(("k", "v"), RowLayout("head", ("k", "v")))
    D.init_tp(1, 2)
    try:
        w = L.QKVParallelLinear(hidden, hd, heads, kv).weight
    finally:
        D.reset_tp()
    view = fused.view(TensorLayout(transpose=True).view(key_value.T.contiguous()), w.tp_split.segments)
    w.weight_loader(w, TensorLayout(transpose=True).view(q.T.contiguous()), "q")
    for seg in ("k", "v"):
        w.weight_loader(w, fused.segment_view(view, seg), seg)
    ref = torch.empty_like(w)
    w.tp_split.load(ref, torch.cat([q, k, v]))
    assert torch.equal(w.data, ref)


def test_segments_of_one_tensor_errors_are_named():
    from xllm_gen.runtime.loading.layout import FusedSource
    from xllm_gen.runtime.loading.weights import WeightRule
    segs = L.QKVParallelLinear(4, 2, 4, 2).weight.tp_split.segments
    with pytest.raises(WeightLoadError, match=r"cannot hold the segments k \[4\], v \[4\]"):
        FusedSource(("k", "v"), RowLayout("head", ("k", "v"))).view(torch.zeros(6, 4), segs)
    with pytest.raises(WeightLoadError, match="the parameter has no segment 'x'"):
        FusedSource(("k", "x")).view(torch.zeros(8, 4), segs)
    with pytest.raises(ValueError, match="two or more distinct segments"):
        FusedSource(("k",))
    with pytest.raises(ValueError, match=r"layout order \['k', 'q'\] must name the segments"):
        FusedSource(("k", "v"), RowLayout("head", ("k", "q")))
    with pytest.raises(ValueError, match="which its FusedSource \\(k\\+v\\) does not hold"):
        WeightRule("w", ("a", "b", "b"), segments=("q", "k", "v"), fused=(FusedSource(("k", "v")), None,
                                                                          FusedSource(("k", "v"))))


_TC = "model.layers.{i}.self_attention.qkv_proj.weight"
_TC_Q = "      q: transformer.h.{i}.self_attention.query.weight\n"
_TC_KV = "transformer.h.{i}.self_attention.key_value.weight"


def _telechat_child(tmp_path, body: str):
    from pathlib import Path

    spec = Path(__file__).resolve().parents[1] / "specs" / "telechat2.yaml"
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {spec}\nname: telechat_child\n" + body)
    return child


def test_segments_of_one_tensor_compile_and_render(tmp_path):
    """specs/telechat2.yaml's `k+v` source: the IR keeps one source name per segment and the group with its layout;
    the generated module lists a FusedSource; a group's layout chosen by a flag renders a RowLayoutChoice that the
    checkpoint's config resolves (its blocked branch: None, nothing to undo)."""
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.ir import LayoutChoice

    compiled = compile_spec(_telechat_child(tmp_path, (
        f"weights:\n  {_TC}:\n    from:\n      k+v:\n        layout:\n          interleave: ~\n          per: ~\n"
        f"          if: \"num_key_value_heads == num_attention_heads\"\n"
        f"          then: {{interleave: [k, v], per: head}}\n          else: {{interleave: [k, v], per: tensor}}\n")))
    weights = {w.param.name: w for w in compiled.ir.weights}
    w = weights[_TC]
    assert w.sources == ("transformer.h.{i}.self_attention.query.weight", _TC_KV, _TC_KV)
    (g,) = w.groups
    assert g.segments == ("k", "v") and isinstance(g.layout, LayoutChoice)
    assert (g.layout.then, g.layout.else_) == (("head", ("k", "v")), None)
    model = compiled.module()
    (fs,) = model.WEIGHT_FUSED_SOURCES[_TC]
    assert fs.layout.cond_text == "num_key_value_heads == num_attention_heads"
    assert fs.resolved(model.Config.from_hf({"n_head": 4, "num_key_value_heads": 4, "hidden_size": 64})).layout == \
        model.RowLayout("head", ("k", "v"))
    assert fs.resolved(model.Config.from_hf({"n_head": 4, "num_key_value_heads": 2, "hidden_size": 64})).layout is None


@pytest.mark.parametrize("body, match", [
    (f"weights:\n  {_TC}:\n    from:\n      k+v: ~\n      k+x: {_TC_KV}\n",
     r"child\.yaml:\d+:\d+: .*from: segments must be \['q', 'k', 'v'\] in this order, got \['q', 'k', 'x'\]"),
    (f"weights:\n  {_TC}:\n    from:\n      k+v: ~\n      v+k: {_TC_KV}\n",
     r"child\.yaml:\d+:\d+: .*from: segments must be \['q', 'k', 'v'\] in this order, got \['q', 'v', 'k'\]"),
    (f"weights:\n  {_TC}:\n    from:\n      q: {{from: \"x.{{i}}.q\"}}\n",
     r"child\.yaml:\d+:\d+: .*from\.q: a mapping of `from` and `layout` reads several segments from one tensor"),
    (f"weights:\n  {_TC}:\n    from:\n      q: ~\n      k+v: ~\n      q+k+v: {{from: \"x.{{i}}.qkv\"}}\n",
     r"child\.yaml:\d+:\d+: .*from\.q\+k\+v: one tensor holds every segment: give `from` its name"),
    (f"weights:\n  {_TC}:\n    from:\n      k+v:\n        layout: {{interleave: [k, q]}}\n",
     r"child\.yaml:\d+:\d+: .*from\.k\+v\.layout\.interleave: must name each of the tensor's segments \['k', 'v'\] "
     r"once, got \['k', 'q'\]"),
    (f"weights:\n  {_TC}:\n    from:\n      k+v:\n        layout: {{per: group, groups: 3}}\n",
     r"child\.yaml:\d+:\d+: error: variants\.TeleChat2-7B: .*from\.k\+v\.layout per: group: k: 32, v: 32: segment "
     r"'k' does not split into 3 groups"),
    (f"weights:\n  {_TC}:\n    from:\n      k+v:\n        layot: {{per: tensor}}\n",
     r"child\.yaml:\d+:\d+: .*layot"),
    (f"weights:\n  {_TC}:\n    layout: {{interleave: [q, k, v], per: head}}\n",
     r"child\.yaml:\d+:\d+: .*a layout describes one fused checkpoint tensor.*`k\+v: \{from: <tensor>, layout"),
    (f"weights:\n  {_TC}:\n    from:\n      k+v:\n        from: transformer.h.0.self_attention.key_value.weight\n",
     r"child\.yaml:\d+:\d+: .*'transformer\.h\.0\.self_attention\.key_value\.weight' is a per-layer tensor"),
])
def test_segments_of_one_tensor_errors_are_located(tmp_path, body, match):
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors

    with pytest.raises((SpecError, SpecErrors), match=match):
        compile_spec(_telechat_child(tmp_path, body))
