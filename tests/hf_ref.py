"""The independent reference: Hugging Face transformers, float32 on CPU, one prompt at a time, no padding.

Greedy continuations ignore EOS the way `SamplingParams(ignore_eos=True)` does: EOS may be generated and
generation goes on (the model's generation_config is replaced by one without eos; `min_new_tokens` is NOT
used, since it would forbid EOS instead of ignoring it).

Models and processors are cached per checkpoint dir. The VL helpers take the processor's own outputs
(`hf_vl_inputs` calls the checkpoint's AutoProcessor exactly as an engine should:
`processor(text=[prompt], images=..., videos=..., return_tensors="pt", **mm_processor_kwargs)`).
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = [
    "hf_model",
    "hf_tokenizer",
    "hf_processor",
    "hf_greedy",
    "hf_prefill_logits",
    "hf_greedy_logprobs",
    "hf_vl_inputs",
    "hf_vl_greedy",
    "hf_vl_prefill_logits",
    "hf_zero_deepstack",
    "hf_blocked_mrope",
]


def _key(ckpt_dir) -> str:
    return str(Path(ckpt_dir).resolve())


@functools.lru_cache(maxsize=None)
def _load_model(key: str):
    import json

    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = json.loads((Path(key) / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    cls = getattr(transformers, arch, None) or AutoModelForCausalLM   # the checkpoint's own model class
    model = cls.from_pretrained(key, dtype=torch.float32, attn_implementation="eager").eval()
    # No EOS, no sampling defaults: greedy until max_new_tokens.
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=None, bos_token_id=None
    )
    return model


def hf_model(ckpt_dir):
    """The HF model of a checkpoint, float32, eval mode, eager attention (cached)."""
    return _load_model(_key(ckpt_dir))


@functools.lru_cache(maxsize=None)
def _load_tokenizer(key: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(key)


def hf_tokenizer(ckpt_dir):
    return _load_tokenizer(_key(ckpt_dir))


@functools.lru_cache(maxsize=None)
def _load_processor(key: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(key)


def hf_processor(ckpt_dir):
    return _load_processor(_key(ckpt_dir))


def _generate(model, inputs: dict, max_new_tokens: int, n_prompt: int, logprobs_out: list | None = None) -> list[int]:
    """Greedy new tokens; with `logprobs_out`, each step's log_softmax [vocab] (float32) is appended to it."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if logprobs_out is not None:
        kw.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        try:
            out = model.generate(**inputs, **kw)
        except ValueError as e:   # transformers 5.25 builds no attention mask over a cache of recurrent layers only
            if "can only be called on Attention layers" not in str(e):   # (Qwen4-Exp without attention layers)
                raise
            out = model.generate(**inputs, **kw, use_cache=False)
    if logprobs_out is not None:
        logprobs_out.extend(torch.log_softmax(step[0].float(), dim=-1) for step in out.logits)
        out = out.sequences
    new = out[0, n_prompt:].tolist()
    assert len(new) == max_new_tokens, f"HF stopped early ({len(new)} of {max_new_tokens} tokens)"
    return new


# ------------------------------------------------------------------------------------------- text models
def hf_greedy(ckpt_dir, prompt_token_ids_list: Sequence[Sequence[int]], max_new_tokens: int,
              logprobs_out: list | None = None) -> list[list[int]]:
    """Greedy continuations (ignoring EOS) of each prompt, one prompt at a time; with `logprobs_out`, one list per
    prompt of each step's log_softmax [vocab] is appended to it."""
    model = hf_model(ckpt_dir)
    outs = []
    for ids in prompt_token_ids_list:
        ids = torch.tensor([list(ids)], dtype=torch.long)
        steps = None if logprobs_out is None else []
        outs.append(_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens,
                              ids.shape[1], steps))
        if logprobs_out is not None:
            logprobs_out.append(steps)
    return outs


def hf_prefill_logits(ckpt_dir, prompt_token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len, vocab] (float32) of one full forward pass over the prompt."""
    model = hf_model(ckpt_dir)
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0].float()


def hf_greedy_logprobs(ckpt_dir, prompt_token_ids: Sequence[int], max_new_tokens: int):
    """(tokens, logprobs): the greedy continuation and, per step, the full log-softmax [vocab] (float32)."""
    model = hf_model(ckpt_dir)
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


# ---------------------------------------------------------------------------------------------- VL models
def hf_vl_inputs(
    ckpt_dir,
    prompt: str,
    images: list | None = None,
    videos: list | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
):
    """The checkpoint processor's outputs for one request (BatchFeature with input_ids, attention_mask,
    mm_token_type_ids and, as present, pixel_values/image_grid_thw, pixel_values_videos/video_grid_thw)."""
    proc = hf_processor(ckpt_dir)
    kwargs = dict(mm_processor_kwargs or {})
    return proc(
        text=[prompt],
        images=list(images) if images else None,
        videos=list(videos) if videos else None,
        return_tensors="pt",
        **kwargs,
    )


def _as_inputs(inputs) -> dict:
    keep = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw")
    d = {k: inputs[k] for k in keep if k in inputs and inputs[k] is not None}
    if "attention_mask" not in d:
        d["attention_mask"] = torch.ones_like(d["input_ids"])
    if "mm_token_type_ids" not in d:
        d["mm_token_type_ids"] = torch.zeros_like(d["input_ids"])
    for k in ("pixel_values", "pixel_values_videos"):
        if k in d:
            d[k] = d[k].float()
    return d


def hf_vl_greedy(ckpt_dir, inputs, max_new_tokens: int) -> list[int]:
    """Greedy continuation (ignoring EOS) of one processed VL request (`hf_vl_inputs(...)` output, or a dict
    with the same keys: input_ids [1, L], pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
    mm_token_type_ids)."""
    model = hf_model(ckpt_dir)
    d = _as_inputs(inputs)
    model.model.rope_deltas = None
    return _generate(model, d, max_new_tokens, d["input_ids"].shape[1])


def hf_vl_prefill_logits(ckpt_dir, inputs) -> torch.Tensor:
    """Logits [len, vocab] (float32) of one full forward pass over a processed VL request."""
    model = hf_model(ckpt_dir)
    d = _as_inputs(inputs)
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(**d, use_cache=False).logits[0].float()
    model.model.rope_deltas = None
    return logits


# ------------------------------------------------------------------------------- sensitivity arms (HF side)
@contextlib.contextmanager
def hf_zero_deepstack():
    """Inside: HF Qwen3-VL adds no deepstack features (as if they were zero)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as M

    orig = M.Qwen3VLTextModel._deepstack_process
    M.Qwen3VLTextModel._deepstack_process = lambda self, hidden_states, mask, embeds: hidden_states
    try:
        yield
    finally:
        M.Qwen3VLTextModel._deepstack_process = orig


@contextlib.contextmanager
def hf_blocked_mrope():
    """Inside: HF Qwen3-VL's text rotary uses Qwen2-VL's blocked mRoPE layout (frequency slots
    [0, s_t) <- T, [s_t, s_t+s_h) <- H, [s_t+s_h, D/2) <- W) instead of the interleaved one."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as M

    orig = M.Qwen3VLTextRotaryEmbedding.recomposition_frequencies

    def blocked(self, freq):  # freq [3, B, N, D/2]
        chunks = freq.split(list(self.mrope_section), dim=-1)
        out = torch.cat([chunks[i][i] for i in range(3)], dim=-1)
        return torch.cat((out, out), dim=-1)

    M.Qwen3VLTextRotaryEmbedding.recomposition_frequencies = blocked
    try:
        yield
    finally:
        M.Qwen3VLTextRotaryEmbedding.recomposition_frequencies = orig
