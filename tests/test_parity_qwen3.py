"""Qwen3 parity with Hugging Face transformers (float32, CPU) on tiny checkpoints built offline.

- prefill logits match HF (max abs error printed, < 1e-4);
- greedy 32-token continuations identical to HF for prompts of different lengths (not multiples of the
  block size 4, so pages are crossed mid-block) submitted in ONE generate call, for tied / untied lm_head
  and kv_heads in {1, 2, heads};
- a tiny KV pool forces preemption: same tokens;
- a sharded checkpoint (several safetensors + index) loads identically;
- EOS / stop tokens end generation (finish_reason "stop"), otherwise "length"; text prompts decode to .text.
The first tests check the fixtures themselves (HF only): greedy decoding is not flat.
"""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hf_ref import hf_greedy, hf_prefill_logits, hf_tokenizer

MAX_TOKENS = 32
VARIANTS = ["qwen3_tied", "qwen3_untied", "qwen3_kv1", "qwen3_mha"]
TEXT_PROMPTS = [
    "Hello, world!",
    "The capital of France is",
    "Once upon a time, in a quiet village by the river, there lived an old clockmaker and his daughter who",
    "a",
]


def _id_prompt(seed: int, length: int, n_tok: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, n_tok) for _ in range(length)]


def prompts_for(ckpt) -> tuple[list, list[list[int]]]:
    """Mixed text and token-id prompts with lengths 1..37 (several not multiples of 4) and their ids."""
    tok = hf_tokenizer(ckpt)
    n_tok = len(tok)  # ids below the tokenizer size only (the config's vocab is padded past it)
    prompts: list = list(TEXT_PROMPTS)
    prompts += [{"prompt_token_ids": _id_prompt(s, n, n_tok)} for s, n in ((11, 5), (12, 9), (13, 37), (14, 8))]
    ids = [tok(p)["input_ids"] if isinstance(p, str) else p["prompt_token_ids"] for p in prompts]
    return prompts, ids


def _sp(**kw):
    from xllm_gen import SamplingParams

    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _assert_same_tokens(got: list[list[int]], want: list[list[int]], label: str = "") -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), (
            f"{label} prompt {i}: first divergence at output position {_first_diff(list(g), list(w))}\n"
            f"  engine: {list(g)}\n  HF:     {list(w)}"
        )
    assert len(got) == len(want)


# ------------------------------------------------------------------------------------ fixtures themselves
@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_greedy_is_not_flat(variant, request):
    ckpt = request.getfixturevalue(variant)
    _, ids = prompts_for(ckpt)
    conts = hf_greedy(ckpt, ids[:6], MAX_TOKENS)
    for c in conts:
        assert len(set(c)) >= 4, f"{variant}: flat greedy continuation {c}"
    assert len({tuple(c) for c in conts}) == len(conts), f"{variant}: prompts share a continuation"


def test_fixture_files(qwen3_tied, qwen3_untied, qwen3_sharded):
    from transformers import AutoConfig, AutoTokenizer

    for ckpt in (qwen3_tied, qwen3_untied):
        names = {p.name for p in ckpt.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json"} <= names
        cfg = json.loads((ckpt / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3ForCausalLM"]
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
        assert len(tok) <= cfg["vocab_size"]
        AutoConfig.from_pretrained(ckpt)
        text = "any text, ünïcode 日本語 <|im_start|> works"
        assert tok.decode(tok(text)["input_ids"]) == text
    shards = sorted(p.name for p in qwen3_sharded.glob("*.safetensors"))
    assert len(shards) >= 3, shards
    index = json.loads((qwen3_sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)


def test_tiny_is_deterministic(tmp_path):
    from fixtures.tiny_hf import make_tiny_qwen3

    a = make_tiny_qwen3(tmp_path / "a", seed=5)
    b = make_tiny_qwen3(tmp_path / "b", seed=5)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.engine
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_hf(variant, request, make_llm):
    ckpt = request.getfixturevalue(variant)
    llm = make_llm(ckpt)
    _, ids = prompts_for(ckpt)
    worst = 0.0
    for p in (ids[3], ids[0], ids[2], ids[6]):  # lengths 1, short, long, 37
        want = hf_prefill_logits(ckpt, p)
        got = torch.as_tensor(llm.prefill_logits(p)).float().cpu()
        assert got.shape == want.shape, (got.shape, want.shape)
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"\n[parity] {variant}: prefill logits max abs error vs HF float32 = {worst:.3e}")
    assert worst < 1e-4, f"{variant}: prefill logits max abs error {worst:.3e}"


@pytest.mark.engine
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_hf_one_batch(variant, request, make_llm):
    ckpt = request.getfixturevalue(variant)
    prompts, ids = prompts_for(ckpt)
    assert len({len(i) for i in ids}) >= 4 and any(len(i) % 4 for i in ids)
    want = hf_greedy(ckpt, ids, MAX_TOKENS)
    llm = make_llm(ckpt)
    outs = llm.generate(prompts, _sp())
    assert len(outs) == len(prompts)
    for o, p_ids in zip(outs, ids):
        assert list(o.prompt_token_ids) == list(p_ids)
        assert o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == MAX_TOKENS
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], want, variant)


@pytest.mark.engine
def test_greedy_same_alone_and_in_batch(qwen3_tied, make_llm):
    """Continuous batching must not change a request's tokens: alone == in a batch (any position)."""
    prompts, ids = prompts_for(qwen3_tied)
    llm = make_llm(qwen3_tied)
    batch = llm.generate(prompts, _sp())
    for i in (0, 6):
        alone = llm.generate([prompts[i]], _sp())
        assert list(alone[0].outputs[0].token_ids) == list(batch[i].outputs[0].token_ids)


def _num_preemptions(llm) -> int:
    for path in ("num_preemptions", "llm_engine.num_preemptions", "llm_engine.scheduler.num_preemptions",
                 "engine.num_preemptions", "engine.scheduler.num_preemptions"):
        obj = llm
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return int(obj)
    raise AssertionError("no preemption counter found: expose LLM.num_preemptions (total since construction)")


@pytest.mark.engine
def test_preemption_keeps_tokens(qwen3_tied, make_llm):
    prompts, ids = prompts_for(qwen3_tied)
    block_size = 4
    need = [math.ceil((len(i) + MAX_TOKENS) / block_size) for i in ids]
    # Room for the largest request plus a little: the batch cannot all run at once.
    num_kv_blocks = max(need) + 2
    assert num_kv_blocks < sum(need) // 2
    llm = make_llm(qwen3_tied, num_kv_blocks=num_kv_blocks)
    before = _num_preemptions(llm)
    outs = llm.generate(prompts, _sp())
    assert _num_preemptions(llm) > before, "the small KV pool did not force any preemption"
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(qwen3_tied, ids, MAX_TOKENS),
                        "preemption")


@pytest.mark.engine
def test_sharded_checkpoint_loads_identically(qwen3_tied, qwen3_sharded, make_llm):
    prompts, ids = prompts_for(qwen3_tied)
    a, b = make_llm(qwen3_tied), make_llm(qwen3_sharded)
    la = torch.as_tensor(a.prefill_logits(ids[2])).float()
    lb = torch.as_tensor(b.prefill_logits(ids[2])).float()
    assert torch.equal(la, lb)
    outs = b.generate(prompts, _sp())
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(qwen3_sharded, ids, MAX_TOKENS),
                        "sharded")


@pytest.mark.engine
def test_hub_style_config(qwen3_hub_config, make_llm):
    """config.json as most Hub checkpoints have it (rope_theta at the top level, torch_dtype)."""
    cfg = json.loads((qwen3_hub_config / "config.json").read_text())
    assert "rope_theta" in cfg and "rope_parameters" not in cfg
    prompts, ids = prompts_for(qwen3_hub_config)
    outs = make_llm(qwen3_hub_config).generate(prompts[:5], _sp())
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(qwen3_hub_config, ids[:5], MAX_TOKENS),
                        "hub-style config")


# --------------------------------------------------------------------------------------- stop conditions
def _prompt_with_eos(ckpt) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy (EOS-ignoring) continuation contains EOS early: (ids, continuation, eos)."""
    eos = json.loads((ckpt / "config.json").read_text())["eos_token_id"]
    n_tok = len(hf_tokenizer(ckpt))
    for seed in (88, 57, 96, *range(200, 400)):  # the first ones hit for qwen3_tied at seed 0
        rng = random.Random(seed)
        ids = [rng.randrange(0, n_tok) for _ in range(rng.randrange(1, 20))]
        cont = hf_greedy(ckpt, [ids], MAX_TOKENS)[0]
        if eos in cont[: MAX_TOKENS - 2]:
            return ids, cont, eos
    pytest.fail("no prompt found whose greedy continuation reaches EOS")


@pytest.mark.engine
def test_eos_stops_unless_ignored(qwen3_tied, make_llm):
    ids, cont, eos = _prompt_with_eos(qwen3_tied)
    k = cont.index(eos)
    llm = make_llm(qwen3_tied)
    other = {"prompt_token_ids": _id_prompt(3, 6, 400)}
    stop = llm.generate([{"prompt_token_ids": ids}, other], _sp(ignore_eos=False))[0]
    assert list(stop.outputs[0].token_ids) == cont[: k + 1], "output must end at (and include) the EOS token"
    assert stop.outputs[0].finish_reason == "stop"
    ignored = llm.generate([{"prompt_token_ids": ids}], _sp(ignore_eos=True))[0]
    assert list(ignored.outputs[0].token_ids) == cont
    assert ignored.outputs[0].finish_reason == "length"


@pytest.mark.engine
def test_stop_token_ids(qwen3_tied, make_llm):
    prompts, ids = prompts_for(qwen3_tied)
    cont = hf_greedy(qwen3_tied, [ids[1]], MAX_TOKENS)[0]
    stop_tok = cont[5]
    k = cont.index(stop_tok)
    out = make_llm(qwen3_tied).generate([prompts[1]], _sp(ignore_eos=False, stop_token_ids=[stop_tok]))[0]
    assert list(out.outputs[0].token_ids) == cont[: k + 1]
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.engine
def test_max_tokens_length_finish(qwen3_tied, make_llm):
    prompts, ids = prompts_for(qwen3_tied)
    cont = hf_greedy(qwen3_tied, [ids[0]], MAX_TOKENS)[0]
    out = make_llm(qwen3_tied).generate([prompts[0]], _sp(max_tokens=7))[0]
    assert list(out.outputs[0].token_ids) == cont[:7]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.engine
def test_text_prompts_decode(qwen3_tied, make_llm):
    tok = hf_tokenizer(qwen3_tied)
    outs = make_llm(qwen3_tied).generate(TEXT_PROMPTS, _sp(max_tokens=12))
    for p, o in zip(TEXT_PROMPTS, outs):
        assert getattr(o, "prompt", p) in (p, None)
        assert list(o.prompt_token_ids) == tok(p)["input_ids"]
        c = o.outputs[0]
        assert isinstance(c.text, str)
        assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True)
