"""The strict loader and checkpoint errors: every problem names the tensor (or field) at fault."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm_gen.runtime.loading import registry
from xllm_gen.runtime.loading.loader import CheckpointError, load_weights
from xllm_gen.runtime.tiny import make_tiny_qwen3


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


def _load(ckpt, dtype=torch.float32):
    module, config, model = _model(ckpt, dtype)
    loaded = load_weights(model, module.weight_plan(config), ckpt, ignored=module.IGNORED_CHECKPOINT_TENSORS)
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
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*not served.*Qwen3ForCausalLM"):
        LLM(model=str(out), device="cpu")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path / "nowhere"), device="cpu")
