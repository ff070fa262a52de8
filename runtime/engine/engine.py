"""LLMEngine: the step loop (schedule -> run -> sample -> finish); the request-level API (add, step outputs, abort)
is engine/requests.py's (EngineRequests), admission (validation per request) engine/admission.py's
(EngineAdmission), the text and the outputs of requests engine/detokenize.py's (EngineOutputs). Rank 0 owns
scheduling and sampling; model runners (one per TP rank) execute."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from xllm_gen.runtime.engine.admission import EngineAdmission
from xllm_gen.runtime.engine.async_decode import AsyncDecode
from xllm_gen.runtime.engine.block_manager import BlockManager
from xllm_gen.runtime.engine.detokenize import EngineOutputs, IncrementalDetokenizer  # noqa: F401 (re-exported)
from xllm_gen.runtime.engine.engine_args import check_engine_args, resolve_device
from xllm_gen.runtime.engine.requests import EngineRequests
from xllm_gen.runtime.engine.sampler import Sampler, greedy_argmax, nonfinite_error
from xllm_gen.runtime.engine.sampling_params import sampling_defaults
from xllm_gen.runtime.engine.scheduler import Scheduler
from xllm_gen.runtime.engine.sequence import Sequence
from xllm_gen.runtime.engine.spec_decode import SpecDecoder, SpeculativeConfig, check_target, load_draft_runner
from xllm_gen.runtime.executor.distributed import SingleRank
from xllm_gen.runtime.loading import registry
from xllm_gen.runtime.loading.checkpoint_files import (
    CheckpointFileError,
    generation_eos_ids,
    load_tokenizer,
    read_config_json,
    read_generation_config,
)
from xllm_gen.runtime.loading.gguf import resolve_model_path
from xllm_gen.runtime.loading.quant_config import kv_cache_torch_dtype, parse_quant_config

logger = logging.getLogger("xllm_gen")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


_SERVABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)     # float64: CPU verification


def resolve_dtype(dtype: Any, hf_config: dict, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _SERVABLE_DTYPES:       # an int / float8 default dtype fails deep in the model build
            raise ValueError(f"dtype {dtype} cannot be served; use torch.float32, torch.bfloat16 or torch.float16 "
                             f"(or 'auto'; torch.float64 for verification on the CPU)")
        return dtype
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32                       # CPU: float32 (parity with HF, and fast enough)
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
        return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def _eos_ids(generation_config: dict, config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None),):
        ids.update(src if isinstance(src, (tuple, list)) else ([src] if src is not None else []))
    ids.update(generation_eos_ids(generation_config))      # validated: ints in the vocabulary
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _mm_preprocess_device(option: Any, device: torch.device, tensor_parallel_size: int) -> Optional[torch.device]:
    """Where image / video preprocessing runs (mm_preprocess_device): "auto" -> the model's device when it is
    not the CPU and the model runs in this process (tensor parallel ranks get the rows pickled over the host
    anyway); "cpu" / None -> the host (the processor's default); another device string -> that device.
    None means the host path."""
    if option is None or option == "cpu":
        return None
    if option == "auto":
        return device if device.type != "cpu" and tensor_parallel_size == 1 else None
    try:
        return torch.device(option)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"mm_preprocess_device must be 'auto', 'cpu' or a device such as 'cuda', got {option!r} "
                         f"({e})") from None


def _tokenizer_size(tok) -> Optional[int]:
    """The number of ids a tokenizer can produce (len(tok): its vocabulary and added tokens), None if unknown."""
    if tok is None:
        return None
    try:
        return int(len(tok))
    except Exception:  # noqa: BLE001 - a tokenizer without __len__: nothing to compare
        return None


class LLMEngine(EngineAdmission, EngineOutputs, EngineRequests):
    spec = None                          # speculative decoding (SpecDecoder), when speculative_config is given
    def __init__(self, model: str, *, device: str = "auto", dtype: Any = "auto", tensor_parallel_size: int = 1,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = False, seed: int = 0,
                 load_format: str = "auto", enable_chunked_prefill: Optional[bool] = None,
                 cuda_graph_sizes: Optional[list] = None, prefill_graph_sizes: Optional[list] = None,
                 debug: Optional[dict] = None,
                 tokenizer: Optional[str] = None, enable_prefix_caching: bool = True, async_scheduling: bool = True,
                 quantization: Optional[str] = None, kv_cache_dtype: str = "auto",
                 mm_preprocess_device: Optional[str] = "cpu", speculative_config: Any = None,
                 generation_config: Any = "auto"):
        spec_cfg = SpeculativeConfig.parse(speculative_config)      # errors name the key, before any loading
        check_engine_args(block_size=block_size, num_kv_blocks=num_kv_blocks,
                           max_num_batched_tokens=max_num_batched_tokens,
                           gpu_memory_utilization=gpu_memory_utilization, seed=seed, load_format=load_format)
        self.tensor_parallel_size = tensor_parallel_size
        self.spec = None
        self.model_dir = resolve_model_path(model)        # a GGUF file: its converted HF checkpoint (cached)
        self.tokenizer_dir = Path(tokenizer) if tokenizer else self.model_dir
        cfg_path = self.model_dir / "config.json"
        self.hf_config = read_config_json(self.model_dir)      # errors name the file (and JSON line / column)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.hf_config, self.device)
        self.mm_preprocess_device = _mm_preprocess_device(mm_preprocess_device, self.device, tensor_parallel_size)
        model_module = None
        try:
            model_module, runner_module = registry.resolve(self.hf_config)
            self.config = model_module.Config.from_hf(self.hf_config)
        except registry.RegistryError:
            raise
        except ValueError as e:          # a field of config.json: name the file too (and a relabelled architecture)
            hint = registry.relabel_hint(self.hf_config, model_module.__name__.rpartition(".")[0]) \
                if model_module is not None else ""
            raise CheckpointFileError(f"{cfg_path}: {str(e).removeprefix('config.json: ')}{hint}") from None
        runner_cls = runner_module.Runner
        try:                             # an unsupported quantization is refused before any process starts
            parse_quant_config(self.hf_config, quantization)
            kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
        except ValueError as e:
            raise CheckpointFileError(f"{cfg_path}: {str(e).removeprefix('config.json ')}") from None
        self.generation_config = read_generation_config(self.model_dir, self.config.vocab_size)
        # the checkpoint's sampling defaults (vLLM's generation_config "auto"): what a request leaves unset
        self.default_sampling = sampling_defaults(generation_config, self.model_dir, self.generation_config,
                                                  self.config.vocab_size)
        if self.default_sampling:
            logger.info("sampling defaults from the generation config (a request's own values win; "
                        "generation_config='vllm' leaves them out): %s", self.default_sampling)
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size != 1:     # impossible sizes fail here, before any process starts
            from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
            check_tensor_parallel(model_module, self.hf_config, tensor_parallel_size, config=self.config)
        ctx_len = self.config.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len and max_model_len > ctx_len:        # refused, never clamped silently
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {ctx_len} tokens "
                             f"(max_position_embeddings in {cfg_path})")
        self.max_model_len = min(max_model_len or ctx_len, ctx_len)
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        # Whole prompts by default; enable_chunked_prefill=True prefills in chunks of max_num_batched_tokens.
        chunked = bool(enable_chunked_prefill)
        self.max_num_batched_tokens = max_num_batched_tokens or (8192 if chunked else max(8192, self.max_model_len))
        # the most tokens one step carries: without chunking a prompt is prefilled whole, alone past the budget (the
        # scheduler's first prompt always fits), so the runner's buffers and attention workspace take max_model_len
        step_tokens = self.max_num_batched_tokens if chunked else max(self.max_num_batched_tokens, self.max_model_len)
        runner_kwargs = dict(device=self.device, dtype=self.dtype, block_size=block_size,
                             num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                             max_model_len=self.max_model_len, max_num_batched_tokens=step_tokens,
                             gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                             load_format=load_format, cuda_graph_sizes=cuda_graph_sizes,
                             prefill_graph_sizes=prefill_graph_sizes, debug=debug, quantization=quantization,
                             kv_cache_dtype=kv_cache_dtype)
        # a draft model (speculative decoding) loads first: on a GPU the target's KV cache takes what it leaves
        check_target(spec_cfg, runner_cls)
        draft = load_draft_runner(spec_cfg, runner_kwargs, tensor_parallel_size, self.config.vocab_size)
        try:
            if tensor_parallel_size > 1:
                from xllm_gen.runtime.executor.tp import TensorParallelRunner
                self.runner = TensorParallelRunner(runner_cls, str(self.model_dir), self.hf_config,
                                                   tensor_parallel_size, runner_kwargs)
            else:
                self.runner = SingleRank(lambda: runner_cls(str(self.model_dir), self.hf_config, **runner_kwargs))
        except BaseException:
            if draft is not None:
                draft[0].shutdown()
            raise
        self._draft = draft
        try:
            num_state_slots = getattr(self.runner, "num_state_slots", 0)
            if num_state_slots and enable_prefix_caching:
                # a cached prefix holds KV, but not the recurrent state at its end: never reuse it for such a model
                logger.info("prefix caching disabled: %s has recurrent-state layers (%s), whose state at the end "
                            "of a cached prefix is not kept", getattr(model_module, "SPEC", "the model"),
                            ", ".join(getattr(model_module, "RECURRENT_LAYERS", ())))
                enable_prefix_caching = False
            self.enable_prefix_caching = bool(enable_prefix_caching)
            self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size,
                                              enable_caching=bool(enable_prefix_caching),
                                              num_state_slots=num_state_slots)
            self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.max_num_batched_tokens, chunked)
            self.sampler = Sampler(seed)
            self.tokenizer = self._load_tokenizer()
            self.mm_processor = None
            if getattr(runner_cls, "multimodal", False):
                from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
                self.mm_processor = MultiModalProcessor(str(self.model_dir), self.hf_config,
                                                        device=self.mm_preprocess_device)
            self.eos_token_ids = _eos_ids(self.generation_config, self.config, self.tokenizer)
            self.chat_template_error = self._check_chat_template()
        except BaseException:
            self.shutdown()              # stop TP ranks at once, not at garbage collection
            raise
        self.vocab_size = self.config.vocab_size
        if spec_cfg is not None:         # speculative decoding (runtime/engine/spec_decode.py)
            try:
                self.spec = SpecDecoder(spec_cfg, self, draft)
            except BaseException:
                self.shutdown()
                raise
            async_scheduling = False
        self._next_id = 0
        self._requests: dict = {}            # request id -> Sequence (add_request / abort_request)
        self._request_of: dict = {}          # seq id -> request id
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0,
                      "spec_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self._last_progress: list[Sequence] = []   # sequences that got a token in the last step
        self._stream_text = False                  # set by step_deltas: detokenize every step
        # False in a serving engine-core process: the API process detokenizes the token ids it receives (and
        # names the logprob tokens); the engine still detokenizes requests with stop strings (it must find them)
        self.detokenize = True
        self._grammar_backend = None               # structured outputs (built on first use)
        # greedy decode steps launched ahead of reading the previous one's tokens (runtime/engine/async_decode.py)
        self._async = None
        if async_scheduling and getattr(self.runner, "supports_async_decode", False):
            self._async = AsyncDecode(self.runner, max_num_seqs, self.device)

    def _load_tokenizer(self):
        """The checkpoint's (or `tokenizer=`) tokenizer; None only when the checkpoint has no tokenizer file (it
        then serves prompt_token_ids). One that is present but cannot be loaded is an error naming the file."""
        tok = load_tokenizer(self.tokenizer_dir, required=self.tokenizer_dir != self.model_dir)
        vocab = self.config.vocab_size
        n = _tokenizer_size(tok)
        if n is not None and n > vocab:       # its last ids have no embedding row: a prompt holding one is refused
            logger.warning("the tokenizer of %s has %d tokens, more than the model's vocab_size %d (config.json): a "
                           "prompt that encodes to one of the ids >= %d is refused; a tokenizer of another model?",
                           self.tokenizer_dir, n, vocab, vocab)
        return tok

    def _check_chat_template(self) -> Optional[str]:
        """The checkpoint's chat template compiled once at load: "<file>, line N: reason" when it does not (logged;
        LLM.chat then refuses without a template of its own, the server refuses to start without --chat-template),
        None when it does. Completions never read it, so the load goes on."""
        if self.mm_processor is None and self.tokenizer is None:
            return None
        from xllm_gen.runtime.engine.chat_template import checkpoint_template_problem
        problem = checkpoint_template_problem(self.model_dir if self.mm_processor is not None else self.tokenizer_dir)
        if problem:
            logger.warning("the chat template does not compile: %s; chat is refused until it is fixed (or a template "
                           "is given), completions are served", problem)
        return problem

    @property
    def structured(self):
        """The structured-outputs backend (runtime/engine/structured_outputs.py), built on first use;
        ValueError when the checkpoint has no tokenizer. Its `compile` is thread-safe and cached: the server
        calls it off the engine thread before admission."""
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this checkpoint has none")
            from xllm_gen.runtime.engine.structured_outputs import GrammarBackend
            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self.sampler.grammar = self._grammar_backend
        return self._grammar_backend
    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One step; returns the sequences that finished in it (also those that failed alone: `.error`).

        Async scheduling: a greedy decode step is launched without waiting for its tokens; the next call
        launches the following decode step (when it can be decided without them) and only then reads them, so
        the host's work overlaps the GPU's. Its tokens and finished sequences are those of the step read."""
        self._last_progress: list[Sequence] = []
        prev = self._async.inflight if self._async is not None else None
        if prev is not None:
            self._async.inflight = None
            ahead = self._async.next_batch(self.scheduler, self.max_model_len)
            if ahead:
                self._async.inflight = self._async.launch(ahead, prev)
                self._count_decode(ahead)
            tokens = self._async.read(prev)
            live = [(s, t) for s, t in zip(prev.seqs, tokens) if not s.is_finished]    # not ended / aborted since
            for s, t in live:                     # non-finite logits: the request fails alone
                if t < 0 and not s.error:
                    s.error = nonfinite_error(s.num_completion_tokens)
            for s, t in live:                     # structured outputs: the grammars accept the tokens read
                if s.grammar is not None and not s.error and not s.grammar.accept_token(t):
                    s.error = f"structured outputs: token {t} does not fit the grammar"
            finished: list[Sequence] = []
            self._accept([s for s, _ in live], [t for _, t in live], finished, commit=True)
            self._fail_errored([s for s, _ in live], finished)
            self._finish_masked()
            return finished
        seqs, is_prefill = self.scheduler.schedule()
        finished = self.scheduler.take_finished_by_capacity()
        if finished:
            logger.warning("%d request(s) outgrew the KV cache (%d blocks of %d tokens) and end with "
                           "finish_reason 'length'", len(finished), self.block_manager.num_blocks,
                           self.block_manager.block_size)
            for seq in finished:
                self._flush(seq)
        if not seqs:
            if finished or not self.scheduler.has_unfinished():
                return finished              # an idle engine: nothing to do
            raise RuntimeError("scheduler made no progress: KV cache too small for any running request")
        if not is_prefill and self.spec is not None and self.spec.step(seqs, finished):
            return finished              # drafts proposed and verified (runtime/engine/spec_decode.py)
        if not is_prefill and self._async is not None and self._async.can_launch(seqs):
            self._async.inflight = self._async.launch(seqs)
            self._count_decode(seqs)
            self._finish_masked()
            return finished
        starts = [s.num_computed_tokens for s in seqs]
        want_prompt_lp = is_prefill and any(
            s.params.prompt_logprobs is not None and len(s.prompt_logprobs or ()) < s.num_prompt_tokens
            for s in seqs)
        if want_prompt_lp:
            rows = self.runner.run(seqs, is_prefill, all_rows=True)
            ends, off = [], 0
            for seq, start in zip(seqs, starts):
                if seq.params.prompt_logprobs is not None:
                    try:
                        self.sampler.record_prompt_logprobs(rows[off:off + seq.chunk_len], seq, start)
                    except Exception as e:
                        seq.error = f"prompt_logprobs failed: {type(e).__name__}: {e}"
                off += seq.chunk_len
                ends.append(off - 1)
            logits = rows[ends]
        else:
            logits = self.runner.run(seqs, is_prefill)
        self.stats["steps"] += 1
        ready = []       # sequences whose logits give a new token (prefill complete, or decode)
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens += seq.chunk_len
            self.block_manager.commit(seq)          # full blocks join the prefix cache
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(i)
        if is_prefill:
            self.stats["prefill_tokens"] += sum(s.chunk_len for s in seqs)
        else:
            self.stats["decode_tokens"] += len(seqs)
        if ready:
            ready_seqs = [seqs[i] for i in ready]
            tokens = self.sampler(logits[ready], ready_seqs, self.eos_token_ids)
            self._accept(ready_seqs, tokens, finished)
        self._fail_errored(seqs, finished)
        return finished

    def _finish_masked(self) -> None:
        """A launched step with structured-output rows: mask and reduce it now that its grammars are current."""
        step = self._async.inflight
        if step is not None and step.tokens is None:
            try:
                self._async.finish_masked(step, self.structured)
            except Exception as e:               # the step's grammar rows fail alone; the others go unmasked
                logger.exception("structured outputs: masking an async step failed")
                for s in step.seqs:
                    if s.grammar is not None:
                        s.error = f"structured outputs failed: {type(e).__name__}: {e}"
                if step.tokens is None:
                    with torch.inference_mode():
                        done = self._async._send(step.seqs, greedy_argmax(step.logits))
                    step.tokens, step.host, step.event, step.logits = done.tokens, done.host, done.event, None

    def _count_decode(self, seqs: list[Sequence]) -> None:
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(seqs)

    def _accept(self, seqs: list[Sequence], tokens: list[Optional[int]], finished: list[Sequence],
                commit: bool = False) -> None:
        """Appends each sequence's new token and finishes those it ends (stop, length); `commit`: register
        the blocks it fills in the prefix cache (async decode registers them once the tokens are known)."""
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            if tok is None or seq.error:
                continue
            seq.append_token(tok)
            if commit:
                self.block_manager.commit(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            self._last_progress.append(seq)
            try:
                reason = self._finish_reason(seq, tok)
            except Exception as e:             # detokenization or stop checks: this request alone
                logger.exception("post-processing failed for sequence %s", seq.seq_id)
                seq.error, reason = f"post-processing failed: {type(e).__name__}: {e}", None
            if reason and not seq.error:
                self.scheduler.finish(seq, reason)
                if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
                    self._flush(seq)
                finished.append(seq)

    def _fail_errored(self, seqs: list[Sequence], finished: list[Sequence]) -> None:
        for seq in seqs:                           # failed after admission: fails alone, blocks freed
            if seq.error and not seq.is_finished:
                self.scheduler.abort(seq)
                seq.finish_reason = "error"
                finished.append(seq)

    @property
    def spec_acceptance_rate(self) -> Optional[float]:
        """Speculative decoding: accepted / proposed draft tokens so far (None: no speculation or no draft yet)."""
        n = self.stats["spec_draft_tokens"] if self.spec is not None else 0
        return self.stats["spec_accepted_tokens"] / n if n else None

    def shutdown(self) -> None:
        """Stops the runner (every TP rank) and releases the model, KV cache and graphs; idempotent."""
        spec = getattr(self, "spec", None)
        if spec is not None:
            spec.shutdown()
        elif getattr(self, "_draft", None) is not None:      # loaded, not yet handed to the SpecDecoder
            self._draft[0].shutdown()
        close = getattr(self.runner, "shutdown", None)
        if close:
            close()
