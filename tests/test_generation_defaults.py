"""The checkpoint's sampling defaults (generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty,
max_new_tokens), as vLLM's generation_config="auto" (its default): offline, `generate` / `chat` without
sampling_params use them (LLM.get_default_sampling_params); over the API, the fields a request leaves unset take
them and the fields it sets win. generation_config="vllm" leaves them out; a directory supplies another file. A
default the sampler would refuse is an error at load naming the file and the field.

The arms that must change the output: a tiny checkpoint whose generation config says top_k 1 at temperature 1.5
samples greedily under "auto" (its tokens equal greedy decoding's) and not under "vllm" (seeded sampling at
temperature 1 over a random model's flat distribution), and max_new_tokens 5 bounds an unset max_tokens."""
from __future__ import annotations

import json
import shutil

import pytest

from xllm_gen import LLM, SamplingParams
from xllm_gen.runtime.engine.sampling_params import generation_defaults
from xllm_gen.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest

PROMPTS = [{"prompt_token_ids": [5, 9, 100, 17]}, {"prompt_token_ids": [3, 3, 41]}]
KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def ckpt(qwen3_tied, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen_defaults") / "ckpt"
    shutil.copytree(qwen3_tied, d)
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(do_sample=True, temperature=1.5, top_k=1, max_new_tokens=5)
    gen_path.write_text(json.dumps(gen))
    return d


@pytest.fixture(scope="module")
def llms(ckpt):
    return {opt: LLM(str(ckpt), generation_config=opt, **KW) for opt in ("auto", "vllm")}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_offline_generate_uses_the_checkpoints_defaults(llms):
    auto, vllm = llms["auto"], llms["vllm"]
    d = auto.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (1.5, 1, 5)
    assert vllm.get_default_sampling_params() == SamplingParams()
    greedy = _tokens(auto.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5)))
    assert _tokens(auto.generate(PROMPTS)) == greedy            # top_k 1: greedy whatever the temperature
    assert _tokens(auto.chat([{"role": "user", "content": "hi"}]))[0] == _tokens(
        auto.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=5)))[0]
    # an explicit SamplingParams is taken as it is (the defaults are only for sampling_params=None)
    explicit = _tokens(auto.generate(PROMPTS, SamplingParams(max_tokens=16, seed=3, ignore_eos=True)))
    assert [len(t) for t in explicit] == [16, 16]
    # sensitivity: without the defaults, vLLM's built-in ones (temperature 1, no top-k, 16 tokens) sample
    plain = _tokens(vllm.generate(PROMPTS))
    assert any(len(t) > 5 for t in plain) and all(p[:5] != g for p, g in zip(plain, greedy))


def test_api_fields_left_unset_take_the_defaults():
    defaults = generation_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7})
    p = CompletionRequest(prompt="hi").sampling_params(100, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 7)
    p = CompletionRequest(prompt="hi", temperature=0.0, top_k=-1, max_tokens=50).sampling_params(100, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.95, -1, 50)     # the request's own win
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(4, defaults)
    assert p.max_tokens == 4                      # the context's bound stays the tighter one
    p = CompletionRequest(prompt="hi").sampling_params(100, {})
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, 100)


def test_bad_defaults_and_options_are_named(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"generation_config.json: field 'top_p' must be in \(0, 1\]"):
        generation_defaults({"top_p": 0.0})
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    gen = json.loads((bad / "generation_config.json").read_text())
    (bad / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": -1.0}))
    with pytest.raises(ValueError, match=r"bad/generation_config.json: field 'repetition_penalty'"):
        LLM(str(bad), **KW)
    LLM(str(bad), generation_config="vllm", **KW)          # not read for sampling: it loads
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        LLM(str(ckpt), generation_config="nowhere", **KW)


def test_another_directory_supplies_the_defaults(qwen3_tied, ckpt):
    llm = LLM(str(qwen3_tied), generation_config=str(ckpt), **KW)
    assert llm.get_default_sampling_params().max_tokens == 5


def test_the_core_process_passes_the_defaults_to_the_api_process(llms):
    from xllm_gen.runtime.serving.core_client import CoreFrontend
    from xllm_gen.runtime.serving.engine_core import engine_info
    info = engine_info(llms["auto"].engine)
    assert CoreFrontend(info).default_sampling == {"temperature": 1.5, "top_k": 1, "max_tokens": 5}
