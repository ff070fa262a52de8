"""The public API, in vLLM's style: LLM(model=dir, ...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import weakref
from typing import Any, Optional, Union
from typing import Sequence as Seq

import torch

from xllm_gen.runtime.engine.engine import LLMEngine
from xllm_gen.runtime.engine.outputs import RequestOutput
from xllm_gen.runtime.engine.sampling_params import SamplingParams

# vLLM arguments that have no meaning here (no remote code, no download): accepted so scripts run unchanged.
_IGNORED_VLLM_KWARGS = {"trust_remote_code", "download_dir", "revision", "disable_log_stats", "swap_space",
                        "disable_custom_all_reduce", "load_format_kwargs"}


class InvalidRequestError(ValueError):
    """Some requests were rejected. The valid ones were served: `.outputs` holds every request's output
    in prompt order, a rejected request's with `.error` set."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs


class LLM:
    def __init__(self, model: str, *, tokenizer: Optional[str] = None, device: str = "auto", dtype: Any = "auto", tensor_parallel_size: int = 1,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = False, seed: int = 0,
                 load_format: str = "auto", enable_chunked_prefill: Optional[bool] = None,
                 cuda_graph_sizes: Optional[list] = None, prefill_graph_sizes: Optional[list] = None,
                 enable_prefix_caching: bool = True, async_scheduling: bool = True,
                 quantization: Optional[str] = None, kv_cache_dtype: str = "auto",
                 mm_preprocess_device: Optional[str] = "cpu",
                 speculative_config: Optional[dict] = None, generation_config: Any = "auto",
                 _debug: Optional[dict] = None, **vllm_kwargs: Any):
        unknown = set(vllm_kwargs) - _IGNORED_VLLM_KWARGS
        if unknown:       # a typo must not pass silently (tensor_parallel=2 would serve on one rank)
            raise TypeError(f"LLM got unknown argument(s) {sorted(unknown)}")
        self.engine = LLMEngine(model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                seed=seed, load_format=load_format,
                                enable_chunked_prefill=enable_chunked_prefill, cuda_graph_sizes=cuda_graph_sizes,
                                prefill_graph_sizes=prefill_graph_sizes,
                                debug=_debug, tokenizer=tokenizer,
                                enable_prefix_caching=enable_prefix_caching,
                                async_scheduling=async_scheduling, quantization=quantization,
                                kv_cache_dtype=kv_cache_dtype, mm_preprocess_device=mm_preprocess_device,
                                speculative_config=speculative_config, generation_config=generation_config)
        # `del llm` (or the object going out of scope) releases the model, KV cache and graphs like shutdown()
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's sampling defaults (its generation_config.json's temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens; with generation_config="auto", vLLM's default), else
        SamplingParams(); `generate` / `chat` use it when given no sampling_params."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: Union[str, dict, Seq[Union[str, dict]]],
                 sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None, *,
                 on_error: str = "raise", use_tqdm: bool = False) -> list[RequestOutput]:
        """Serves every valid request; outputs come back in prompt order.

        A bad request (empty prompt, too long, token id out of vocab, bad sampling values, bad images)
        does not fail the others: with on_error="raise" (default) an InvalidRequestError naming each bad
        request is raised after the valid ones are served (its .outputs has them all); with
        on_error="return" the bad request's output carries .error instead."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, on_error=on_error, use_tqdm=use_tqdm)

    def _run(self, prompts: list, sampling_params=None, *, on_error: str = "raise", use_tqdm: bool = False,
             failed: Optional[dict] = None) -> list[RequestOutput]:
        """generate's work; `failed`: index -> why, requests that already failed before admission (a chat
        conversation that cannot be rendered), reported like an admission error."""
        if on_error not in ("raise", "return"):
            raise ValueError("on_error must be 'raise' or 'return'")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        outputs: list[Optional[RequestOutput]] = [None] * len(prompts)
        errors = []
        self._calls = getattr(self, "_calls", 0) + 1
        keys: dict = {}                      # engine request id -> prompt index
        bar = None
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                key = ("generate", self._calls, i)
                try:
                    if failed and i in failed:
                        raise ValueError(failed[i])
                    engine.add_request(key, prompt, p)
                except ValueError as e:
                    msg = str(e).replace(f"request {key}", f"request {i}")
                    msg = msg if msg.startswith(f"request {i}") else f"request {i}: {msg}"
                    errors.append(msg)
                    text = prompt if isinstance(prompt, str) else (
                        prompt.get("prompt") if isinstance(prompt, dict) else None)
                    outputs[i] = RequestOutput(i, text if isinstance(text, str) else None, [], [], True, msg)
                    continue
                keys[key] = i
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(keys), desc="generate")
            while engine.scheduler.has_unfinished():
                for out in engine.step_outputs():
                    i = keys.pop(out.request_id, None)
                    if i is None:
                        continue
                    out.request_id = i
                    if out.error:
                        out.error = f"request {i}: {out.error}"
                        errors.append(out.error)
                    outputs[i] = out
                    if bar:
                        bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call (Ctrl-C or a failing rank mid-batch).
            for key in keys:
                engine.abort_request(key)
            for q in (engine.scheduler.waiting, engine.scheduler.running):
                while q:
                    engine.scheduler.abort(q[0])
            raise
        finally:
            if bar:
                bar.close()
        if errors and on_error == "raise":
            raise InvalidRequestError("; ".join(errors), outputs)
        return outputs

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None, *,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             mm_processor_kwargs: Optional[dict] = None, chat_template_kwargs: Optional[dict] = None,
             tools: Optional[list] = None, continue_final_message: bool = False, on_error: str = "raise",
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, rendered with the checkpoint's chat
        template (its processor's for multimodal checkpoints). Content parts {"type": "image", "image": PIL}
        and {"type": "video", "video": frames} become placeholders plus multi_modal_data, in order.
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) and `tools` (OpenAI's list) reach the template;
        `continue_final_message` (vLLM's; with add_generation_prompt=False): the last message is left open and the
        reply continues it.
        A conversation that cannot be rendered (malformed messages, the template's own error) fails alone, as a bad
        prompt does in `generate`: named by its index, the others served, `on_error` as there."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true (pass "
                             "add_generation_prompt=False)")
        if continue_final_message:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "continue_final_message": True}
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        engine = self.engine
        renderer = engine.mm_processor.processor if engine.mm_processor is not None else engine.tokenizer
        if renderer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this checkpoint has none")
        from xllm_gen.runtime.engine.chat_template import template_problem
        if chat_template is None and getattr(engine, "chat_template_error", None):    # every conversation would fail
            raise ValueError(f"chat is not available: the checkpoint's chat template does not compile: "
                             f"{engine.chat_template_error}; fix it, or pass chat_template=")
        problem = template_problem(chat_template) if chat_template is not None else None
        if problem:
            raise ValueError(f"chat_template does not compile: {problem}")
        prompts: list = []
        failed: dict = {}
        for i, conv in enumerate(conversations):
            try:
                prompts.append(self._chat_prompt(renderer, conv, chat_template, add_generation_prompt, tools,
                                                 chat_template_kwargs, mm_processor_kwargs,
                                                 text_only=engine.mm_processor is None))
            except ValueError as e:
                prompts.append(None)
                failed[i] = str(e)
        return self._run(prompts, sampling_params, failed=failed, on_error=on_error, use_tqdm=use_tqdm)

    @staticmethod
    def _chat_prompt(renderer, conv, chat_template, add_generation_prompt, tools, chat_template_kwargs,
                     mm_processor_kwargs, text_only: bool = True) -> dict:
        """One conversation's engine prompt; ValueError saying why it cannot be rendered. `text_only`: the renderer
        is a text tokenizer (not a multimodal processor, whose templates take the parts)."""
        from xllm_gen.runtime.engine.chat_template import message_problem, takes_content_parts, template_of
        if not isinstance(conv, list):
            raise ValueError(f"a conversation is a list of messages, got {type(conv).__name__}")
        media: dict[str, list] = {"image": [], "video": []}
        if text_only and any(isinstance(m, dict) and _text_parts(m.get("content")) is not None for m in conv) \
                and not takes_content_parts(template_of(renderer, chat_template, tools)):
            # a template that takes content as a string gets a message's text parts joined by newlines (vLLM's
            # "string" content format); one that loops over the parts gets them as they are
            conv = [{**m, "content": "\n".join(_text_parts(m["content"]))}
                    if isinstance(m, dict) and _text_parts(m.get("content")) is not None else m for m in conv]
        for k, message in enumerate(conv):
            problem = message_problem(f"messages[{k}]", message)
            if problem:
                raise ValueError(problem)
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in media:
                    if kind not in part:
                        raise ValueError(f"a {kind!r} content part needs the {kind} under key {kind!r}")
                    media[kind].append(part[kind])
        try:
            text = renderer.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, tools=tools,
                                                **(chat_template_kwargs or {}))
        except Exception as e:        # no template, malformed messages
            raise ValueError(f"cannot apply the chat template: {type(e).__name__}: {e}") from None
        prompt: dict = {"prompt": text, "add_special_tokens": False}     # the template wrote them
        if media["image"] or media["video"]:
            prompt["multi_modal_data"] = {k: v for k, v in media.items() if v}
            prompt["mm_processor_kwargs"] = dict(mm_processor_kwargs or {})
        return prompt

    @torch.inference_mode()
    def prefill_logits(self, prompt: Union[list, str, dict]) -> torch.Tensor:
        """Float32 logits [len, vocab] of every prompt position (a test hook for parity checks).
        `prompt` is a list of token ids or any prompt `generate` accepts (text, token ids, multimodal)."""
        engine = self.engine
        if isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        seq = engine.make_sequence(0, prompt, SamplingParams(max_tokens=1))
        engine.block_manager.allocate(seq, seq.num_tokens)
        seq.chunk_len = seq.num_tokens
        try:
            return engine.runner.run([seq], True, all_rows=True)
        finally:
            engine.block_manager.free(seq)

    def shutdown(self) -> None:
        """Stops the engine and releases its memory (GPU included) now; idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


# content part kinds that hold text (vLLM's): the kind -> the key of its text
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _text_parts(content) -> Optional[list]:
    """The texts of a message content that is a list of text parts only; None for anything else."""
    if not isinstance(content, list) or not content:
        return None
    out = []
    for part in content:
        key = _TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            return None
        out.append(part[key])
    return out
