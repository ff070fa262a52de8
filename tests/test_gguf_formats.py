"""GGUF checkpoints beyond one llama file (runtime/loading/gguf.py): other architectures as the gguf package names
them, K-quants, split sets, a token list of another length than the embedding, heads of a size the config class does
not default to. Tiny checkpoints written as llama.cpp's converter writes them (tests/quant_ckpt.py write_gguf); the
reference is transformers on the float32 checkpoint of what the file holds (the gguf package's dequantization, HF
names), not transformers' own GGUF loading, so what the conversion adds or loses shows.

- qwen2 (Q4_1), qwen3 (Q8_0, head_dim 16: not Qwen3's default 128), phi3 (fused q|k|v and gate|up, Q5_0), gemma2
  (Q8_0): greedy tokens equal the reference's;
- K-quants Q2_K .. Q6_K mixed as a Q4_K_M file mixes them (random codes: the gguf package writes no K-quants): equal;
  one super-block scale of one tensor doubled: no longer equal;
- a split set (-00001-of-00002 ...): served from the directory or any of its files, as the single file is; a file of
  the set missing: named;
- a file without `<arch>.vocab_size` whose token list is shorter than the embedding: served with the embedding's
  rows (it failed to load: the vocabulary size was the token count).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hf_ref import hf_greedy

from tests.fixtures.tiny_hf import _padded_vocab, make_tiny_checkpoint

pytest.importorskip("gguf")
from quant_ckpt import K_QUANT_FIELDS, write_gguf  # noqa: E402

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 10
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)
SMALL = dict(vocab_size=_padded_vocab(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XLLM_GEN_CACHE", str(tmp_path / "cache"))


def _greedy(model) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams
    llm = LLM(model=str(model), **OPTS)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,qtype,overrides", [
    ("Qwen2ForCausalLM", "Q4_1", {}),
    ("Qwen3ForCausalLM", "Q8_0", dict(head_dim=16)),
    ("Phi3ForCausalLM", "Q5_0", dict(vocab_size=32064)),       # (Phi-3's pad id 32000 must be a row)
    ("Gemma2ForCausalLM", "Q8_0", dict(query_pre_attn_scalar=256)),   # (the GGUF keys hold none: the default)
])
def test_architectures(tmp_path, arch, qtype, overrides):
    base = make_tiny_checkpoint(arch, tmp_path / "base", overrides={**SMALL, **overrides})
    (tmp_path / "g").mkdir()
    f = write_gguf(base, tmp_path / "g" / f"tiny.{qtype}.gguf", qtype, deq=tmp_path / "deq")
    assert _greedy(f) == hf_greedy(tmp_path / "deq", PROMPTS, N_NEW)


def _q4_k_m(name: str) -> str:
    """A Q4_K_M-like mix over the five K-quant types (hidden 256: one super-block a row)."""
    if "embed" in name or "lm_head" in name or "v_proj" in name:
        return "Q6_K"
    return {"q_proj": "Q4_K", "k_proj": "Q5_K", "o_proj": "Q3_K", "gate_proj": "Q4_K", "up_proj": "Q2_K",
            "down_proj": "Q6_K"}.get(name.split(".")[-2], "F32")


@pytest.fixture(scope="module")
def k_quants(tmp_path_factory):
    d = tmp_path_factory.mktemp("kq")
    base = make_tiny_checkpoint("Qwen2ForCausalLM", d / "base", overrides={
        **SMALL, "hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": False})
    (d / "g").mkdir()
    return base, write_gguf(base, d / "g" / "tiny.Q4_K_M.gguf", _q4_k_m, deq=d / "deq"), d / "deq"


def test_k_quants(k_quants, tmp_path):
    import gguf
    base, f, deq = k_quants
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(f)).tensors}
    assert set(K_QUANT_FIELDS) <= types, types
    want = hf_greedy(deq, PROMPTS, N_NEW)
    assert _greedy(f) == want
    # one super-block scale (d) of every row of layer 0's Q6_K down_proj doubled: the tokens move
    (tmp_path / "bad").mkdir()
    name = "blk.0.ffn_down.weight"
    raw = bytearray(f.read_bytes())
    t = next(t for t in gguf.GGUFReader(str(f)).tensors if t.name == name)
    size, (off,) = K_QUANT_FIELDS["Q6_K"]
    start = int(t.data_offset)
    for blk in range(t.n_bytes // size):
        at = start + blk * size + off
        d = torch.frombuffer(bytearray(raw[at:at + 2]), dtype=torch.float16) * 2
        raw[at:at + 2] = d.numpy().tobytes()
    (tmp_path / "bad" / f.name).write_bytes(bytes(raw))
    assert _greedy(tmp_path / "bad" / f.name) != want


def test_split_set(tmp_path):
    base = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "base", overrides=SMALL)
    (tmp_path / "one").mkdir()
    (tmp_path / "set").mkdir()
    one = write_gguf(base, tmp_path / "one" / "tiny.gguf", "Q8_0", deq=tmp_path / "deq")
    first = write_gguf(base, tmp_path / "set" / "tiny.gguf", "Q8_0", split_max_tensors=12)
    files = sorted((tmp_path / "set").iterdir())
    assert [p.name for p in files] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)] and first == files[0]
    want = hf_greedy(tmp_path / "deq", PROMPTS, N_NEW)
    assert _greedy(one) == want
    for model in (tmp_path / "set", files[0], files[2]):
        assert _greedy(model) == want, model
    shutil.move(files[1], tmp_path / files[1].name)
    with pytest.raises(ValueError, match=r"split GGUF set of 3, but tiny-00002-of-00003\.gguf is missing"):
        _greedy(files[0])


def test_token_list_shorter_than_the_embedding(tmp_path):
    base = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "base", overrides=SMALL)
    (tmp_path / "g").mkdir()
    f = write_gguf(base, tmp_path / "g" / "tiny.gguf", "Q8_0", tokens=[f"t{i}" for i in range(300)],
                   deq=tmp_path / "deq")
    assert _greedy(f) == hf_greedy(tmp_path / "deq", PROMPTS, N_NEW)


def test_conversion_is_cached_per_file_set(tmp_path):
    """The converted checkpoint is keyed by every file of a set (a re-written second file converts anew)."""
    from xllm_gen.runtime.loading.gguf import _cache_dir
    base = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "base", overrides=SMALL)
    (tmp_path / "set").mkdir()
    first = write_gguf(base, tmp_path / "set" / "tiny.gguf", "Q8_0", split_max_tensors=12)
    before = _cache_dir(first)
    second = sorted(Path(first).parent.iterdir())[1]
    second.write_bytes(second.read_bytes())
    import os
    os.utime(second, ns=(1, 1))
    assert _cache_dir(first) != before
