"""Load faults that tests/test_checkpoint_faults.py does not list, found by adversarial probing of checkpoint loading
and engine construction: each is one ValueError naming the option, the file or the tensor (never torch's error from
deep inside the build, a request-time ZeroDivisionError, an OOM kill, or a silently different model).

- engine options: num_kv_blocks 0 / negative / float (0 was read as "auto"; others failed in torch.zeros), block_size
  0 (every request failed with ZeroDivisionError) / negative / absurd (the KV cache OOM-killed the process),
  max_num_batched_tokens 0 / negative (taken as the default / accepted), gpu_memory_utilization outside (0, 1], a
  seed that is not an int (TypeError in the sampler), an unknown load_format (ignored), an unknown device string or
  CUDA on a host without it (torch RuntimeErrors), a non-float torch dtype (blamed on config.json), a tokenizer= dir
  that does not exist (transformers' "Repo id must be ..." message);
- safetensors files: one tensor in two files without an index (the later file's copy was served silently), an index
  naming a shard outside the checkpoint dir (read from there), an index that is not UTF-8, an index naming a
  directory ("No such device (os error 19)");
- quantized checkpoints: AWQ / GPTQ errors name the file, float64 scales no longer read "dtype F64, expected a float
  dtype", a float g_idx is refused (was cast silently), a NaN scale is named as the stored tensor and its file (was
  the dequantized '.weight' and "file ?");
- a tokenizer with more ids than the embedding rows: a warning at load (a prompt holding such an id is refused).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def _llm(d, **kw):
    from xllm_gen import LLM
    kw.setdefault("device", "cpu")
    kw.setdefault("num_kv_blocks", 8)
    return LLM(model=str(d), **kw)


def _refused(d, pattern, **kw) -> str:
    with pytest.raises(ValueError, match=pattern) as info:
        _llm(d, **kw)
    msg = str(info.value)
    assert info.value.__cause__ is None and "\n" not in msg.strip(), msg
    return msg


def _shard(d: Path) -> dict:
    """Splits model.safetensors into two shards with an index; returns its weight_map."""
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    files = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    wm = {}
    for f, ns in files.items():
        save_file({n: t[n] for n in ns}, str(d / f), metadata={"format": "pt"})
        wm.update({n: f for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


# ---------------------------------------------------------------------------------------------- engine options
@pytest.mark.parametrize("kw,pattern", ([
    ({"num_kv_blocks": 0}, r"num_kv_blocks must be an integer >= 1.*got 0"),
    ({"num_kv_blocks": -3}, r"num_kv_blocks must be an integer >= 1.*got -3"),
    ({"num_kv_blocks": 2.5}, r"num_kv_blocks must be an integer >= 1.*got 2\.5"),
    ({"block_size": 0}, r"block_size must be an integer >= 1.*got 0"),
    ({"block_size": -16}, r"block_size must be an integer >= 1.*got -16"),
    ({"block_size": 10 ** 7}, r"block_size 10000000 is larger than any KV-cache block size"),
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be an integer >= 1.*got 0"),
    ({"max_num_batched_tokens": -1}, r"max_num_batched_tokens must be an integer >= 1.*got -1"),
    ({"gpu_memory_utilization": 2.0}, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 2\.0"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a fraction in \(0, 1\], got 0"),
    ({"seed": "x"}, r"seed must be an integer, got 'x'"),
    ({"load_format": "pt"}, r"load_format 'pt' is not supported"),
    ({"device": "tpu"}, r"device 'tpu' is not a device"),
    ({"dtype": torch.int32}, r"dtype torch\.int32 cannot be served"),
    ({"dtype": torch.float8_e4m3fn}, r"dtype torch\.float8_e4m3fn cannot be served"),
]), ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "refused")
def test_engine_option_refused_by_name(qwen3_untied, kw, pattern):
    _refused(qwen3_untied, pattern, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host with CUDA serves device='cuda'")
def test_cuda_device_without_cuda_is_named(qwen3_untied):
    _refused(qwen3_untied, r"device 'cuda': CUDA is not available on this host", device="cuda")


def test_missing_tokenizer_dir_is_named(qwen3_untied, tmp_path):
    _refused(qwen3_untied, rf"{tmp_path / 'nope'}: the tokenizer dir does not exist", tokenizer=str(tmp_path / "nope"))


# ---------------------------------------------------------------------------------------------- safetensors files
def test_tensor_stored_in_two_files_is_refused(qwen3_untied, tmp_path):
    """Without an index, a second *.safetensors file holding a tensor of the first: the copy served depended on the
    files' sorted order (a stray file shadowed the weight silently)."""
    d = _copy(qwen3_untied, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    save_file({"model.norm.weight": t["model.norm.weight"] * 2}, str(d / "zz-extra.safetensors"))
    msg = _refused(d, r"tensor 'model\.norm\.weight' is stored in two files, model\.safetensors and "
                      r"zz-extra\.safetensors")
    assert str(d) in msg


def test_index_naming_a_file_outside_the_dir_is_refused(qwen3_untied, tmp_path):
    d = _copy(qwen3_untied, tmp_path)
    wm = _shard(d)
    shutil.move(str(d / "a.safetensors"), str(tmp_path / "a.safetensors"))
    wm = {n: ("../a.safetensors" if f == "a.safetensors" else f) for n, f in wm.items()}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    _refused(d, r"model\.safetensors\.index\.json: weight_map names '\.\./a\.safetensors' for '.*', a path outside "
                r"the checkpoint dir")


def test_index_not_utf8_or_naming_a_directory(qwen3_untied, tmp_path):
    d = _copy(qwen3_untied, tmp_path)
    wm = _shard(d)
    index = d / "model.safetensors.index.json"
    index.write_bytes(b"\xff\xfe{}")
    _refused(d, r"model\.safetensors\.index\.json: not UTF-8 text \(byte 0xff at offset 0\)")
    (d / "sub").mkdir()
    index.write_text(json.dumps({"weight_map": {n: ("sub" if f == "a.safetensors" else f) for n, f in wm.items()}}))
    _refused(d, rf"{d / 'sub'}: is a directory, not a safetensors file")


# ---------------------------------------------------------------------------------------------- quantized
@pytest.fixture(scope="module")
def gptq(qwen3_untied, tmp_path_factory):
    from quant_ckpt import write_gptq
    root = tmp_path_factory.mktemp("gptq")
    ckpt, _ = write_gptq(qwen3_untied, root / "q", root / "ref", group=32)
    return ckpt


_L = "model.layers.0.mlp.down_proj"


def _edit(src: Path, tmp_path: Path, edit) -> Path:
    d = _copy(src, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("edit,pattern", [
    (lambda t: t.__setitem__(f"{_L}.scales", t[f"{_L}.scales"].double()),
     rf"tensor '{_L}\.scales': dtype F64, expected F16, BF16 or F32 \(file .*model\.safetensors\)"),
    (lambda t: t.__setitem__(f"{_L}.qweight", t[f"{_L}.qweight"].float()),
     rf"tensor '{_L}\.qweight': dtype F32, expected I32 .*\(file .*model\.safetensors\)"),
    (lambda t: t.__setitem__(f"{_L}.g_idx", t[f"{_L}.g_idx"].float()),
     rf"tensor '{_L}\.g_idx': dtype F32, expected I32 \(group indices\) \(file .*model\.safetensors\)"),
    (lambda t: t[f"{_L}.scales"].view(-1).__setitem__(0, float("nan")),
     rf"tensor '{_L}\.scales' -> parameter '{_L}\.weight': \d+ NaN / infinite value\(s\) .*\(file .*"
     rf"model\.safetensors\)"),
], ids=["scales_f64", "qweight_float", "g_idx_float", "scales_nan"])
def test_quantized_tensor_faults_name_tensor_and_file(gptq, tmp_path, edit, pattern):
    d = _edit(gptq, tmp_path, edit)
    assert str(d) in _refused(d, pattern)


# ---------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_with_more_ids_than_the_embedding_warns(qwen3_untied, tmp_path, caplog):
    from xllm_gen import SamplingParams

    d = _copy(qwen3_untied, tmp_path)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    tj = json.loads((d / "tokenizer.json").read_text())
    start = max(t["id"] for t in tj["added_tokens"]) + 1
    extra = [f"<extra_{i}>" for i in range(vocab - start + 4)]          # past the embedding rows
    tj["added_tokens"] += [{"id": start + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, c in enumerate(extra)]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with caplog.at_level(logging.WARNING, logger="xllm_gen"):
        llm = _llm(d)
    try:
        assert any(f"more than the model's vocab_size {vocab}" in r.getMessage() and str(d) in r.getMessage()
                   for r in caplog.records), caplog.text
        tok = llm.get_tokenizer()
        ids = tok.encode(extra[-1], add_special_tokens=False)
        assert ids and ids[-1] >= vocab, ids
        out = llm.generate([extra[-1], "hi"], SamplingParams(max_tokens=1), on_error="return")
        assert out[0].error and "out of vocabulary" in out[0].error and out[1].error is None
    finally:
        llm.shutdown()


def test_huge_max_position_embeddings_builds_no_table_of_that_size(qwen3_untied, tmp_path):
    """A config's max_position_embeddings of 1e9 loads and generates at the engine's context: the rotary table covers
    the positions the engine serves (max_model_len), not 1e9 rows (32 GB: the first step used to fail allocating)."""
    import json

    from xllm_gen import SamplingParams
    d = _copy(qwen3_untied, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 10 ** 9
    (d / "config.json").write_text(json.dumps(cfg))
    llm = _llm(d, max_model_len=64)
    try:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
