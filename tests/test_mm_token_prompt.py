"""Token-id prompts with image / video placeholders (runtime.multimodal.token_prompt): the expansion, wrapper
included, is the installed processor's own, so the engine follows transformers <= 5.24 (a video keeps its outer
`<|vision_start|>...<|vision_end|>`) and >= 5.25 (Qwen3-VL's processor drops it) alike."""
from __future__ import annotations

import json

import numpy as np
import pytest

from xllm_gen.runtime.multimodal.token_prompt import (
    items_text,
    pick_separator,
    placeholder_spans,
    replace_spans,
    split_expansions,
)

TF = tuple(int(v) for v in __import__("transformers").__version__.split(".")[:2])
VS, VE, IMG, VID = 503, 504, 505, 506


@pytest.fixture(scope="module")
def mmp(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl

    from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
    ckpt = make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_tp"), seed=0)
    return MultiModalProcessor(str(ckpt), json.loads((ckpt / "config.json").read_text()))


def _video(t, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, 32, 32, 3), dtype=np.uint8)


def test_spans_split_and_replace():
    ids = [1, VS, IMG, VE, 2, VID, 3, VS, VID, 4, VS, VID, VE]
    spans = placeholder_spans(ids, IMG, VID, VS, VE)
    assert spans == [(1, 4, IMG), (5, 6, VID), (8, 9, VID), (10, 13, VID)]    # half-wrapped: bare
    text = items_text(ids, spans, {VS: "<s>", VE: "</s>", IMG: "<i>", VID: "<v>"}, "|")
    assert text == "|<s><i></s>|<v>|<v>|<s><v></s>|"
    assert split_expansions([0, 9, 7, 9, 8, 8, 9, 9, 6, 9, 0], 9, 4) == [[7], [8, 8], [], [6]]
    assert split_expansions([9, 7, 9], 9, 2) is None
    assert replace_spans(ids, spans, [[7], [8, 8], [], [6]]) == [1, 7, 2, 8, 8, 3, VS, 4, 6]


def test_wrapper_follows_installed_processor(mmp):
    """A wrapped video placeholder in the ids expands exactly as the processor expands the same text, and the
    outer wrapper is kept (<= 5.24) or dropped (>= 5.25) as the installed transformers does."""
    vid = _video(8)
    prompt = "A\n<|vision_start|><|video_pad|><|vision_end|>\nB"
    ids = mmp.tokenizer(prompt)["input_ids"]
    ref = mmp.processor(text=[prompt], videos=[vid], return_tensors="pt")["input_ids"][0].tolist()
    out = mmp.process(0, None, ids, {"video": [vid]}, {})
    assert out.prompt_token_ids == ref
    frames = int(out.video_grid_thw[0, 0])
    wrappers = out.prompt_token_ids.count(mmp.vision_start_token_id) - frames
    assert wrappers == (0 if TF >= (5, 25) else 1), (TF, wrappers)
    # sensitivity: a bare placeholder (no wrapper in the ids) is expanded as the bare text, never re-wrapped
    bare = mmp.tokenizer("A\n<|video_pad|>\nB")["input_ids"]
    ref_bare = mmp.processor(text=["A\n<|video_pad|>\nB"], videos=[vid], return_tensors="pt")["input_ids"][0]
    out_bare = mmp.process(0, None, bare, {"video": [vid]}, {})
    assert out_bare.prompt_token_ids == ref_bare.tolist()
    assert out_bare.prompt_token_ids.count(mmp.vision_start_token_id) == frames
    assert (out_bare.prompt_token_ids == out.prompt_token_ids) == (TF >= (5, 25))   # 5.25: the wrapper collapses


def test_separator_choice_and_refusal(mmp):
    sep, sid = pick_separator(mmp.tokenizer, mmp._vision_ids)
    assert sid not in mmp._vision_ids and mmp.tokenizer(sep, add_special_tokens=False)["input_ids"] == [sid]
    mmp._separator = ()                    # a tokenizer without any other special token: refused by name
    try:
        ids = mmp.tokenizer("<|vision_start|><|video_pad|><|vision_end|>")["input_ids"]
        with pytest.raises(ValueError, match="request 5:.*special token.*send the prompt as text"):
            mmp.process(5, None, ids, {"video": [_video(4)]}, {})
    finally:
        mmp._separator = None
