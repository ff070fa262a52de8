"""The strict loader and checkpoint errors: every problem names the tensor (or field) at fault."""
from __future__ import annotations

import inspect
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm_gen.runtime.loading import registry
from xllm_gen.runtime.loading.loader import CheckpointError, load_weights

try:
    from fixtures.tiny_hf import make_tiny_qwen3
except ImportError:                                   # before the tiny makers moved to tests/fixtures
    from xllm_gen.default_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("loader") / "ckpt", tie_word_embeddings=False)


def _copy_with(tiny, tmp_path, edit):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _model(ckpt, dtype=torch.float32):
    hf = json.loads((ckpt / "config.json").read_text())
    module, _ = registry.resolve(hf)
    config = module.Config.from_hf(hf)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = module.Model(config)
    finally:
        torch.set_default_dtype(old)
    return module, config, model


def _plan(module, model, config):
    """The generated weight plan: `weight_plan(model)` (names only), or `weight_plan(config)` before it."""
    first = next(iter(inspect.signature(module.weight_plan).parameters))
    return module.weight_plan(model if first == "model" else config)


def _load(ckpt, dtype=torch.float32):
    module, config, model = _model(ckpt, dtype)
    loaded = load_weights(model, _plan(module, model, config), ckpt, ignored=module.IGNORED_CHECKPOINT_TENSORS)
    return model, loaded


def test_every_parameter_loaded_once(tiny):
    model, loaded = _load(tiny)
    assert loaded == {n for n, _ in model.named_parameters()}


def test_missing_tensor_is_named(tiny, tmp_path):
    ckpt = _copy_with(tiny, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        _load(ckpt)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    ckpt = _copy_with(tiny, tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in the checkpoint: model\.layers\.0\.mlp\.extra\.weight"):
        _load(ckpt)


def test_misshaped_tensor_is_named(tiny, tmp_path):
    def edit(t):
        w = t["model.layers.0.mlp.down_proj.weight"]
        t["model.layers.0.mlp.down_proj.weight"] = w[:, :-1].contiguous()
    ckpt = _copy_with(tiny, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*dim 1"):
        _load(ckpt)


def test_dtype_conversion(tiny, tmp_path):
    """A bf16 checkpoint loads into float32 parameters (and a float32 one into bf16) by conversion."""
    ckpt = _copy_with(tiny, tmp_path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    model, _ = _load(ckpt, torch.float32)
    want = load_file(str(ckpt / "model.safetensors"))["model.norm.weight"].float()
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.equal(model.model.norm.weight.detach(), want)
    model16, _ = _load(tiny, torch.bfloat16)
    assert model16.model.norm.weight.dtype == torch.bfloat16


def test_index_naming_a_missing_file(tiny, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    names = list(load_file(str(out / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*file is missing"):
        _load(out)


def test_config_errors_name_the_field(tiny, tmp_path):
    from xllm_gen import LLM
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["num_attention_heads"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(model=str(out), device="cpu")
    cfg["num_attention_heads"] = 4
    cfg["architectures"] = ["NoSuchModelForCausalLM"]   # an architecture no spec serves
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"NoSuchModelForCausalLM.*not served.*Qwen3ForCausalLM"):
        LLM(model=str(out), device="cpu")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path / "nowhere"), device="cpu")


# ---- unreadable files, bad index, dtypes, shapes -------------------------------------------------------
def _copy_dir(tiny, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    return out


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_unreadable_safetensors_file_is_named(tiny, tmp_path, how):
    out = _copy_dir(tiny, tmp_path)
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"not a safetensors file" * 50}[how])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        _load(out)


def test_unreadable_file_named_by_the_index(tiny, tmp_path):
    out = _copy_dir(tiny, tmp_path)
    names = list(load_file(str(out / "model.safetensors")))
    (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
    (out / "model-00001-of-00001.safetensors").write_bytes(b"")
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001\.safetensors: not a readable safetensors"):
        _load(out)


@pytest.mark.parametrize("index", ['{"metadata": {}}', '[1, 2]', '{"weight_map": ["a"]}', "{not json"])
def test_index_without_weight_map_is_named(tiny, tmp_path, index):
    out = _copy_dir(tiny, tmp_path)
    (out / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: (no 'weight_map'|not valid JSON)"):
        _load(out)


def test_index_naming_a_tensor_its_file_lacks(tiny, tmp_path):
    out = _copy_dir(tiny, tmp_path)
    names = list(load_file(str(out / "model.safetensors")))
    index = {"weight_map": {n: "model.safetensors" for n in names + ["model.layers.0.mlp.ghost.weight"]}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    module, config, model = _model(out)
    plan = _plan(module, model, config)
    plan[0] = type(plan[0])(plan[0].param, ("model.layers.0.mlp.ghost.weight",))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read tensor 'model\.layers\.0\.mlp\.ghost"):
        load_weights(model, plan, out, ignored=module.IGNORED_CHECKPOINT_TENSORS)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_tensor_for_float_parameter_is_refused(tiny, tmp_path, dtype):
    name = "model.layers.1.post_attention_layernorm.weight"
    ckpt = _copy_with(tiny, tmp_path, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}': dtype (I64|I32|BOOL) cannot fill "
                                              rf"the floating-point parameter"):
        _load(ckpt)


@pytest.mark.parametrize("name, cut, expect", [
    ("model.layers.0.self_attn.k_proj.weight", lambda w: w[:-1], r"shape \(31, 64\), expected \(32, 64\).*segment 'k'"),
    ("model.layers.0.mlp.up_proj.weight", lambda w: w[:, :-3], r"shape \(128, 61\), expected \(128, 64\).*dim 1"),
    ("model.layers.0.self_attn.q_proj.weight", lambda w: w.reshape(-1), r"shape \(4096,\), expected \(64, 64\)"),
    ("model.embed_tokens.weight", lambda w: w[:-1], r"expected \(\d+, 64\) \(vocab size"),
    ("model.norm.weight", lambda w: w[None], r"shape \(1, 64\), expected \(64,\)"),
])
def test_misshaped_tensor_message_names_tensor_and_shapes(tiny, tmp_path, name, cut, expect):
    """Before any slicing, concatenation or indexing: the tensor, the parameter, expected and actual shape."""
    ckpt = _copy_with(tiny, tmp_path, lambda t: t.__setitem__(name, cut(t[name]).contiguous()))
    with pytest.raises(CheckpointError) as err:
        _load(ckpt)
    msg = str(err.value)
    assert msg.startswith(f"tensor {name!r} -> parameter "), msg
    assert re.search(expect, msg), msg


def test_unknown_or_missing_segment_names_the_parameter(tiny):
    from xllm_gen.runtime.loading.weights import WeightRule
    module, config, model = _model(tiny)
    plan = _plan(module, model, config)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    src = tuple(f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
    i = next(j for j, r in enumerate(plan) if r.param == qkv)
    bad = list(plan)
    bad[i] = WeightRule(qkv, src, ("q", "k", "gate"))
    with pytest.raises(CheckpointError, match=rf"parameter '{qkv}'.*QKVParallelLinear has no segment 'gate': "
                                              r"its segments are q, k, v"):
        load_weights(model, bad, tiny, ignored=module.IGNORED_CHECKPOINT_TENSORS)
    bad[i] = WeightRule(qkv, src[:2], ("q", "k"))
    with pytest.raises(CheckpointError, match=rf"parameter '{qkv}': the weight plan fills segments q, k but not v"):
        load_weights(model, bad, tiny, ignored=module.IGNORED_CHECKPOINT_TENSORS)
    norm = "model.norm.weight"
    bad = [WeightRule(r.param, r.sources, ("q",)) if r.param == norm else r for r in plan]
    with pytest.raises(CheckpointError, match=rf"parameter '{norm}'.*has no segment 'q'"):
        load_weights(model, bad, tiny, ignored=module.IGNORED_CHECKPOINT_TENSORS)


# ---- each rank reads its rows --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """Untied, vocabulary 520 (not a multiple of 64 * tp: padding rows), 4 q heads, 2 KV heads."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("loader_tp") / "ckpt", vocab_size=520, tie_word_embeddings=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_rows(odd_vocab, tp):
    """Column (rows), row (columns; bias whole), merged gate/up and q/k/v per segment, KV heads replicated at
    tp=4 with 2 KV heads (rank r holds head r // 2), vocab rows padded with zeros, norms whole."""
    from xllm_gen.runtime.executor import distributed as D
    from xllm_gen.runtime.executor.sharding import padded_vocab
    full = load_file(str(odd_vocab / "model.safetensors"))
    hf = json.loads((odd_vocab / "config.json").read_text())
    H, KV, Dh, V = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["vocab_size"]
    inter = hf["intermediate_size"]
    assert (H, KV, V) == (4, 2, 520)
    for rank in range(tp):
        D.init_tp(rank, tp)
        try:
            model, loaded = _load(odd_vocab)
        finally:
            D.reset_tp()
        p = dict(model.named_parameters())
        L0 = "model.layers.0."
        h = H // tp
        kv_head = rank // (tp // KV) if KV < tp else rank * (KV // tp)
        kvn = max(1, KV // tp)
        want_qkv = torch.cat([full[L0 + "self_attn.q_proj.weight"][rank * h * Dh:(rank + 1) * h * Dh],
                              full[L0 + "self_attn.k_proj.weight"][kv_head * Dh:(kv_head + kvn) * Dh],
                              full[L0 + "self_attn.v_proj.weight"][kv_head * Dh:(kv_head + kvn) * Dh]])
        assert torch.equal(p[L0 + "self_attn.qkv_proj.weight"].detach(), want_qkv)
        cols = H * Dh // tp
        assert torch.equal(p[L0 + "self_attn.o_proj.weight"].detach(),
                           full[L0 + "self_attn.o_proj.weight"][:, rank * cols:(rank + 1) * cols])
        n = inter // tp
        want_gu = torch.cat([full[L0 + "mlp.gate_proj.weight"][rank * n:(rank + 1) * n],
                             full[L0 + "mlp.up_proj.weight"][rank * n:(rank + 1) * n]])
        assert torch.equal(p[L0 + "mlp.gate_up_proj.weight"].detach(), want_gu)
        assert torch.equal(p[L0 + "mlp.down_proj.weight"].detach(),
                           full[L0 + "mlp.down_proj.weight"][:, rank * n:(rank + 1) * n])
        assert torch.equal(p["model.norm.weight"].detach(), full["model.norm.weight"])
        per = padded_vocab(V, tp) // tp
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = torch.zeros(padded_vocab(V, tp), hf["hidden_size"])
            padded[:V] = full[name]
            assert torch.equal(p[name].detach(), padded[rank * per:(rank + 1) * per]), (name, rank)
        assert loaded == set(p)


def test_loader_refuses_a_model_built_for_another_rank(odd_vocab):
    from xllm_gen.runtime.executor import distributed as D
    module, config, model = _model(odd_vocab)              # built at tp=1
    with pytest.raises(CheckpointError, match=r"built for tp rank 0/1, but the loader was asked for rank 1/2"):
        load_weights(model, _plan(module, model, config), odd_vocab, tp_size=2, tp_rank=1,
                     ignored=module.IGNORED_CHECKPOINT_TENSORS)
    assert D.get_tp_size() == 1


def _strip_base_prefix(t):
    for k in [k for k in t if k.startswith("model.")]:
        t[k[len("model."):]] = t.pop(k)


def test_checkpoint_saved_without_the_base_model_prefix(tiny, tmp_path):
    """transformers' base_model_prefix rule: the hub files of GPT-2, BLOOM and OPT were saved from the base model
    ('h.0.attn.c_attn.weight', 'decoder.layers.0...'), and the causal-LM class reads them under its prefix. The
    loader does the same: every parameter gets the prefixed checkpoint's values. A checkpoint with both forms is
    not rewritten (its unprefixed tensors stay unexpected, named)."""
    want, _ = _load(tiny)
    ckpt = _copy_with(tiny, tmp_path, _strip_base_prefix)
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(ckpt / "model.safetensors"))
    got, loaded = _load(ckpt)
    assert loaded == {n for n, _ in got.named_parameters()}
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    both = _copy_with(tiny, tmp_path / "both",
                      lambda t: t.__setitem__("layers.0.mlp.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in the checkpoint: layers\.0\.mlp\.extra"):
        _load(both)
