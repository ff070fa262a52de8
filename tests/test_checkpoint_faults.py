"""Checkpoint faults (issue 11, checkpoints): every fault of a checkpoint dir is one error that names the file
and the tensor or config field, with no traceback, from `LLM(...)` and from `xllm-gen-generate`.

Hand-written faults (one test each): truncated / empty / garbage safetensors, mis-shaped tensors, integer
and bool weights, a NaN / infinite weight value (named by its stored tensor, also inside a fused parameter), zero / negative / absurd sizes and a NaN in config.json, values the model cannot be built from
(more layers than layer_types lists, an odd rotary head_dim), config.json that is a list, not
JSON or not UTF-8, an index without weight_map, a malformed generation_config.json (bad JSON, a list, a
field of the wrong type, an eos id outside the vocabulary), a corrupt or empty tokenizer.json /
tokenizer_config.json (an error, never silently dropped). A hypothesis fuzz corrupts the files of a tiny
checkpoint in many ways (bytes flipped, truncated, JSON fields replaced) and asserts that LLM(...) either
loads or raises one ValueError naming a file of the checkpoint, never another exception.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from fixtures.tiny_hf import make_tiny_qwen3
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("faults") / "ckpt", tie_word_embeddings=False)


def _copy(tiny, tmp_path, name="ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(tiny, out)
    return out


def _tensors(d: Path, edit):
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def _cfg(d: Path, **kw):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def _write(d: Path, name: str, data):
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


_W = "model.layers.0.mlp.down_proj.weight"
_N = "model.norm.weight"

# name -> (how to break the copy, regex the message must match: the file and the field / tensor)
FAULTS = {
    "safetensors_truncated": (lambda d: _write(d, "model.safetensors", (d / "model.safetensors").read_bytes()[:5000]),
                              r"model\.safetensors: not a readable safetensors file"),
    "safetensors_empty": (lambda d: _write(d, "model.safetensors", b""),
                          r"model\.safetensors: not a readable safetensors file \(0 bytes\)"),
    "safetensors_garbage": (lambda d: _write(d, "model.safetensors", os.urandom(4096)),
                            r"model\.safetensors: not a readable safetensors file"),
    "tensor_misshaped": (lambda d: _tensors(d, lambda t: t.__setitem__(_W, t[_W][:, :7].contiguous())),
                         rf"tensor '{re.escape(_W)}' -> parameter .*shape .*expected .*model\.safetensors"),
    "tensor_wrong_rank": (lambda d: _tensors(d, lambda t: t.__setitem__(_N, torch.zeros(3, 3))),
                          rf"tensor '{re.escape(_N)}' -> parameter .*2 dims, expected 1.*model\.safetensors"),
    "tensor_int": (lambda d: _tensors(d, lambda t: t.__setitem__(_N, t[_N].to(torch.int32))),
                   rf"tensor '{re.escape(_N)}': dtype I32 cannot fill .*model\.safetensors"),
    "tensor_bool": (lambda d: _tensors(d, lambda t: t.__setitem__(_N, t[_N] > 0)),
                    rf"tensor '{re.escape(_N)}': dtype BOOL cannot fill .*model\.safetensors"),
    # a corrupted weight: served, every logit turns NaN and greedy decoding emits token 0 silently
    "tensor_nan": (lambda d: _tensors(d, lambda t: t[_W].view(-1).__setitem__(5, float("nan"))),
                   rf"tensor '{re.escape(_W)}' -> parameter .*: 1 NaN / infinite value\(s\) .*model\.safetensors"),
    "tensor_inf_in_fused": (lambda d: _tensors(d, lambda t: t["model.layers.1.self_attn.k_proj.weight"].view(-1)
                                               .__setitem__(0, float("-inf"))),
                            r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' -> parameter "
                            r"'model\.layers\.1\.self_attn\.qkv_proj\.weight': 1 NaN / infinite"),
    "size_zero": (lambda d: _cfg(d, hidden_size=0), r"config\.json: .*'hidden_size' = 0 must be in \[1, "),
    "size_negative": (lambda d: _cfg(d, num_attention_heads=-4), r"config\.json: .*'num_attention_heads' = -4"),
    "kv_heads_zero": (lambda d: _cfg(d, num_key_value_heads=0), r"config\.json: .*'num_key_value_heads' = 0"),
    "head_dim_zero": (lambda d: _cfg(d, head_dim=0), r"config\.json: .*'head_dim' = 0"),
    "vocab_zero": (lambda d: _cfg(d, vocab_size=0), r"config\.json: .*'vocab_size' = 0"),
    "layers_negative": (lambda d: _cfg(d, num_hidden_layers=-1), r"config\.json: .*'num_hidden_layers' = -1"),
    "context_zero": (lambda d: _cfg(d, max_position_embeddings=0), r"config\.json: .*'max_position_embeddings' = 0"),
    "size_absurd": (lambda d: _cfg(d, hidden_size=2 ** 40), r"config\.json: .*'hidden_size' = 1099511627776"),
    "size_float": (lambda d: _cfg(d, hidden_size=64.0), r"config\.json: .*'hidden_size' = 64\.0 is not an int"),
    # values each valid alone, that the model cannot be built from: where in the generated code, which layer
    "layers_past_layer_types": (lambda d: _cfg(d, num_hidden_layers=5),
                                r"config\.json: specs/qwen3\.yaml: the model cannot be built from this config: "
                                r"config\.json field 'layer_types' lists 2 entries, one per layer, but layer 2 is built "
                                r"\(num_hidden_layers = 5\); "
                                r"IndexError: .*building layer \d+, qwen3/model\.py:\d+: .*layer_types\[layer_idx\]"),
    # issue 22's fault corpus: more layers than the files hold; a relabelled architecture; malformed layer_types
    "layers_past_tensors": (lambda d: _cfg(d, num_hidden_layers=4, layer_types=["full_attention"] * 4),
                            r"missing tensor 'model\.layers\.2\.[\w.]+': the checkpoint holds model\.layers\.\* for 2 "
                            r"layers \(0\.\.1\), not layer 2; config\.json asks for more layers \(num_hidden_layers\)"),
    "relabelled_architecture": (lambda d: _cfg(d, architectures=["LlamaForCausalLM"], model_type="llama"),
                                r"config\.json: specs/llama\.yaml: does not model config\.json field\(s\) layer_types.*; "
                                r"but this config reads without error as Qwen3ForCausalLM \(specs/qwen3\.yaml\)"
                                r"( or \w+ \(specs/\w+\.yaml\))*: was `architectures` relabelled \(model_type is "
                                r"'llama'\)\?"),
    "layer_types_string": (lambda d: _cfg(d, layer_types="full_attention"),
                           r"config\.json: specs/qwen3\.yaml: config\.json field 'layer_types' = 'full_attention' is "
                           r"not a list of strings"),
    "layer_types_unknown": (lambda d: _cfg(d, layer_types=["bogus_attention"] * 2),
                            r"config\.json: transformers rejects this config: .*layer_types"),
    "head_dim_odd": (lambda d: _cfg(d, head_dim=15),
                     r"config\.json: .*cannot be built .*rotary head_dim must be even, got 15 \(building layer 0"),
    "eps_nan": (lambda d: _write(d, "config.json", (d / "config.json").read_text().replace(
        '"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')), r"config\.json: .*'rms_norm_eps' = nan"),
    "config_list": (lambda d: _write(d, "config.json", "[1, 2]"),
                    r"config\.json: the top level must be an object.*got list"),
    "config_not_json": (lambda d: _write(d, "config.json", '{"a": '), r"config\.json: not valid JSON: .* line 1 column"),
    "config_not_utf8": (lambda d: _write(d, "config.json", b"\xff\xfe{}"), r"config\.json: not UTF-8"),
    "index_without_weight_map": (lambda d: _write(d, "model.safetensors.index.json", '{"metadata": {}}'),
                                 r"model\.safetensors\.index\.json: no 'weight_map'"),
    "index_list": (lambda d: _write(d, "model.safetensors.index.json", "[]"),
                   r"model\.safetensors\.index\.json: no 'weight_map'"),
    "generation_config_not_json": (lambda d: _write(d, "generation_config.json", "{nope"),
                                   r"generation_config\.json: not valid JSON"),
    "generation_config_list": (lambda d: _write(d, "generation_config.json", "[]"),
                               r"generation_config\.json: the top level must be an object"),
    "generation_config_eos_type": (lambda d: _write(d, "generation_config.json", '{"eos_token_id": "x"}'),
                                   r"generation_config\.json: field 'eos_token_id' = 'x'"),
    "generation_config_eos_range": (lambda d: _write(d, "generation_config.json", '{"eos_token_id": [99999]}'),
                                    r"generation_config\.json: field 'eos_token_id' has token id 99999"),
    "generation_config_temperature": (lambda d: _write(d, "generation_config.json", '{"temperature": "hot"}'),
                                      r"generation_config\.json: field 'temperature' = 'hot'"),
    "tokenizer_corrupt": (lambda d: _write(d, "tokenizer.json", "{corrupt"), r"tokenizer\.json: not valid JSON"),
    "tokenizer_empty": (lambda d: _write(d, "tokenizer.json", ""), r"tokenizer\.json: not valid JSON"),
    "tokenizer_config_corrupt": (lambda d: _write(d, "tokenizer_config.json", "{"),
                                 r"tokenizer_config\.json: not valid JSON"),
    "tokenizer_unloadable": (lambda d: _write(d, "tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}'),
                             r"the tokenizer \(tokenizer\.json.*\) cannot be loaded"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_from_llm_names_file_and_field(tiny, tmp_path, fault):
    from xllm_gen import LLM

    d = _copy(tiny, tmp_path)
    breaker, pattern = FAULTS[fault]
    breaker(d)
    with pytest.raises(ValueError) as info:
        LLM(model=str(d), device="cpu")
    msg = str(info.value)
    assert str(d) in msg, msg                                  # the file, with its checkpoint dir
    assert re.search(pattern, msg), msg
    assert "Traceback" not in msg and "\n" not in msg.strip(), msg   # one error
    assert info.value.__cause__ is None, "a chained exception would print a second traceback"


def test_checkpoint_without_tokenizer_still_serves_token_ids(tiny, tmp_path):
    from xllm_gen import LLM, SamplingParams

    d = _copy(tiny, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    llm = LLM(model=str(d), device="cpu")
    try:
        assert llm.get_tokenizer() is None
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


# each arm is a CLI process (~3 s): two by default (a tensor fault, a config fault), the rest with --runslow
@pytest.mark.parametrize("fault", ["safetensors_truncated", "kv_heads_zero"] + [
    pytest.param(f, marks=pytest.mark.slow)
    for f in ("tensor_misshaped", "generation_config_list", "tokenizer_corrupt", "layers_past_tensors")])
def test_fault_from_the_cli_is_one_line(tiny, tmp_path, fault):
    d = _copy(tiny, tmp_path)
    breaker, pattern = FAULTS[fault]
    breaker(d)
    proc = subprocess.run([sys.executable, "-m", "xllm_gen.runtime.cli", "--model", str(d), "--prompt", "hi",
                           "--max-tokens", "2", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in err if ln.startswith("error: ")]
    assert len(errors) == 1 and str(d) in errors[0] and re.search(pattern, errors[0]), proc.stderr


# ------------------------------------------------------------------------------------------------- fuzz
_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
          "model.safetensors.index.json"]
_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2 ** 31, 2 ** 63, -2 ** 40]),
                         st.floats(allow_nan=False), st.text(max_size=5), st.lists(st.integers(-2, 600), max_size=3),
                         st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@st.composite
def corruption(draw):
    name = draw(st.sampled_from(_FILES))
    how = draw(st.sampled_from(["truncate", "flip", "json_field", "json_delete"]
                               if name.endswith(".json") else ["truncate", "flip", "header"]))
    return name, how, draw(st.integers(0, 2 ** 30)), draw(st.binary(min_size=1, max_size=6)), draw(_JSON_VALUES)


def _apply(d: Path, name, how, pos, junk, value):
    path = d / name
    if name == "model.safetensors.index.json":
        names = list(load_file(str(d / "model.safetensors")))
        path.write_text(json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[:pos % (len(raw) + 1)])
    elif how == "flip":
        at = pos % max(len(raw), 1)
        path.write_bytes(raw[:at] + junk + raw[at + len(junk):])
    elif how == "header":                       # inside the safetensors JSON header (first bytes after its length)
        at = 8 + pos % 200
        path.write_bytes(raw[:at] + junk + raw[at + len(junk):])
    else:
        data = json.loads(raw)
        if not isinstance(data, dict) or not data:
            return
        keys = sorted(data)
        key = keys[pos % len(keys)]
        if how == "json_delete":
            del data[key]
        else:
            data[key] = value
        path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def fuzz_dir(tiny):
    d = Path(tempfile.mkdtemp(prefix="xllm-ckpt-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=15, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(corruption())
def test_corrupted_checkpoint_loads_or_names_a_file(tiny, fuzz_dir, case):
    from xllm_gen import LLM

    d = fuzz_dir / "ckpt"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(tiny, d)
    _apply(d, *case)
    try:
        llm = LLM(model=str(d), device="cpu", num_kv_blocks=8)
    except ValueError as e:
        msg = str(e)
        assert str(d) in msg and "Traceback" not in msg, f"{case}: {msg}"
        assert e.__cause__ is None, f"{case}: chained {e.__cause__!r}"
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{case}: {type(e).__name__}: {e}")
    llm.shutdown()


def test_tied_head_with_a_different_stored_head_is_refused(tiny, tmp_path):
    """config.json ties the head to the embedding but the checkpoint also stores an lm_head.weight: an equal copy
    serves (tied, as transformers); a different one is refused naming both tensors, because transformers then does
    not tie them and serves the stored head (the engine tied it: another model, silently)."""
    from test_spec_battery import Tokens, _assert_same
    from transformers import AutoModelForCausalLM

    from xllm_gen import LLM

    d = _copy(tiny, tmp_path)
    _cfg(d, tie_word_embeddings=True)
    _tensors(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    tokens = Tokens()
    _assert_same(tokens.engine(d, 1), tokens.hf(d), "tied head stored twice")
    other = _copy(tiny, tmp_path, "other")
    _cfg(other, tie_word_embeddings=True)          # the tiny's own untied head, now stored beside a tying config
    with pytest.raises(ValueError, match=r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'.*"
                                         r"tie_word_embeddings"):
        LLM(model=str(other), device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)    # transformers: untied, as stored


def test_model_build_error_names_the_config_fields_of_the_failing_statement(tiny_checkpoint, tmp_path):
    """A config each of whose values is valid alone but that the model cannot be built from (Phi with a
    partial_rotary_factor giving odd rotary dims, which transformers cannot run either): the error names the spec, the
    generated line, and the config fields that statement reads with their values (partial_rotary_factor = 0.45)."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM
    ckpt = edit_config(tiny_checkpoint("PhiForCausalLM"), tmp_path / "odd",
                       lambda c: c.setdefault("rope_parameters", {}).__setitem__("partial_rotary_factor", 0.45))
    with pytest.raises(Exception, match=r"specs/phi\.yaml: the model cannot be built from this config: ValueError: "
                                        r"rotary dims must be even, got 7 .*config fields it reads: .*"
                                        r"partial_rotary_factor = 0\.45"):
        LLM(str(ckpt), device="cpu", dtype="float32")
