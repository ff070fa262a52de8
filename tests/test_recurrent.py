"""Recurrent-state layers (runtime/layers/recurrent.py, the state pool of model_runner / block_manager) on the tiny
Qwen3-Next checkpoint (gated DeltaNet layers around a gated full-attention layer, MoE with a shared expert):

- the block manager's state slots: one per sequence, taken with its first blocks, given back on free (finish,
  abort, preemption) and never handed out twice;
- greedy parity with transformers float32 with chunked prefill (chunks of 5 tokens) over several concurrent
  sequences of different lengths, each sequence equal to transformers alone;
- the state carries: zeroing the state before every decode step, or the conv state at a prefill chunk boundary,
  changes the tokens (sensitivity arms, test hooks of LLM(..., _debug=));
- preemption by recompute (a KV pool too small for all sequences) resets the slot and keeps the tokens;
- prefix caching is turned off for such a model, and prompts sharing a prefix still decode right;
- speculative decoding is refused by name at LLM() construction;
- TP: a key-head count the TP size does not divide is refused, naming the field (slow: TP 2 parity).
The plain parity arms (TP 1, TP 2) and the features-ON config are the spec / conformance batteries'.
"""
from __future__ import annotations

import pytest
import torch

from xllm_gen.runtime.engine.block_manager import BlockManager
from xllm_gen.runtime.engine.sequence import Sequence

ARCH = "Qwen3NextForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3)), [400, 401, 3, 2, 1, 0, 9]]
MAX_TOKENS = 10


def _hf_tokens(ckpt, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    import transformers
    model = transformers.Qwen3NextForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def _engine_tokens(ckpt, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        stats = dict(preemptions=llm.engine.scheduler.num_preemptions,
                     prefix_caching=llm.engine.block_manager.enable_caching,
                     free_slots=len(llm.engine.block_manager.free_slots),
                     slots=llm.engine.block_manager.num_state_slots)
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH)


@pytest.fixture(scope="module")
def want(ckpt):
    return _hf_tokens(ckpt)


def test_state_slots_follow_the_sequences():
    bm = BlockManager(num_blocks=8, block_size=4, num_state_slots=2)
    a, b, c = (Sequence(i, [1, 2, 3, 4, 5], None) for i in range(3))
    assert bm.can_allocate(a, 5)
    bm.allocate(a, 5)
    bm.allocate(b, 5)
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not bm.can_allocate(c, 5)            # blocks are free, but no slot: c waits
    with pytest.raises(RuntimeError, match="out of slots"):
        bm.allocate(c, 5)
    bm.allocate(a, 9)                           # growing keeps the slot
    assert a.state_slot in (0, 1) and len(a.block_table) == 3
    slot = a.state_slot
    bm.free(a)                                  # finish / abort / preemption: the slot goes back
    assert a.state_slot is None and bm.can_allocate(c, 5)
    bm.allocate(c, 5)
    assert c.state_slot == slot
    assert BlockManager(8, 4).free_slots == [] and Sequence(9, [1], None).state_slot is None


def test_chunked_prefill_concurrent_sequences(ckpt, want):
    got, stats = _engine_tokens(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=3)
    assert got == want
    assert stats["free_slots"] == stats["slots"] == 4      # max_num_seqs + 1, all given back
    assert not stats["prefix_caching"]                     # turned off for a model with recurrent layers


def test_state_carries(ckpt, want):
    zeroed, _ = _engine_tokens(ckpt, _debug={"zero_state_at_decode": True})
    assert zeroed != want, "zeroing the recurrent state between decode steps did not change the tokens"
    dropped, _ = _engine_tokens(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5,
                                _debug={"drop_conv_state_at_chunk": True})
    assert dropped != want, "dropping the conv state at a prefill chunk boundary did not change the tokens"


def test_preemption_resets_the_state(ckpt, want):
    got, stats = _engine_tokens(ckpt, num_kv_blocks=12, block_size=4, max_num_seqs=4)
    assert stats["preemptions"] > 0
    assert got == want


def test_shared_prefix_without_prefix_caching(ckpt):
    prefix = list(range(100, 140))
    prompts = [prefix + [7, 8], prefix + [9], prefix + [7, 8]]
    got, stats = _engine_tokens(ckpt, prompts=prompts, max_tokens=6, enable_prefix_caching=True, block_size=4)
    assert not stats["prefix_caching"]
    assert got == _hf_tokens(ckpt, prompts, 6)


def test_speculative_decoding_refused(ckpt):
    from xllm_gen import LLM
    with pytest.raises(ValueError, match=r"speculative_config: .*qwen3_next.*recurrent-state layers \(linear_attn\)"):
        LLM(str(ckpt), device="cpu", dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_tp_refuses_an_indivisible_key_head_count(ckpt):
    import json

    from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
    from xllm_gen.runtime.loading import registry
    hf = json.loads((ckpt / "config.json").read_text())
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=r"2 key heads \(config.json linear_num_key_heads\)"):
        check_tensor_parallel(model_module, hf, 4)     # 2 key heads over 4 ranks


@pytest.mark.slow
def test_tp2_chunked_prefill(ckpt, want):
    got, _ = _engine_tokens(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=5)
    assert got == want


@pytest.mark.slow
def test_mamba2_chunked_prefill(tiny_checkpoint):
    """Mamba-2 (SSD chunks of 8: the prompts span several, and the engine's prefill chunks of 5 cut across them)."""
    import transformers
    ckpt = tiny_checkpoint("Mamba2ForCausalLM")
    model = transformers.Mamba2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    got, _ = _engine_tokens(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=3)
    assert got == want
    zeroed, _ = _engine_tokens(ckpt, _debug={"zero_state_at_decode": True})
    assert zeroed != want, "zeroing the SSM and conv states between decode steps did not change the tokens"


@pytest.mark.slow
@pytest.mark.parametrize("arch", [ARCH, "Mamba2ForCausalLM"])
def test_bfloat16_decode_accumulates_like_transformers(tiny_checkpoint, arch):
    """bfloat16: the decode step's conv and SSD output accumulate in float32 (as transformers' conv1d / bmm do); a
    bfloat16 sum of the kernel's products changed Qwen3-Next's tokens at the second decode step."""
    import transformers
    ckpt = tiny_checkpoint(arch)
    model = getattr(transformers, arch).from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    prompts = PROMPTS[:2]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="bfloat16") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True))]
    assert got == want
