"""LLMEngine: admission (validation per request), the step loop (schedule -> run -> sample -> finish),
and detokenization. Rank 0 owns scheduling and sampling; model runners (one per TP rank) execute."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from xllm_gen.runtime.loading import registry
from xllm_gen.runtime.engine.block_manager import BlockManager, blocks_for
from xllm_gen.runtime.engine.outputs import CompletionOutput, RequestOutput
from xllm_gen.runtime.engine.sampler import Sampler
from xllm_gen.runtime.engine.sampling_params import SamplingParams
from xllm_gen.runtime.engine.scheduler import Scheduler
from xllm_gen.runtime.engine.sequence import Sequence

logger = logging.getLogger("xllm_gen")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_dtype(dtype: Any, hf_config: dict, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32                       # CPU: float32 (parity with HF, and fast enough)
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
        return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def _eos_ids(model_dir: Path, config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None),):
        ids.update(src if isinstance(src, (tuple, list)) else ([src] if src is not None else []))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else ([e] if e is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, model: str, *, device: str = "auto", dtype: Any = "auto", tensor_parallel_size: int = 1,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = False, seed: int = 0,
                 load_format: str = "auto", enable_chunked_prefill: Optional[bool] = None,
                 cuda_graph_sizes: Optional[list] = None, debug: Optional[dict] = None):
        self.model_dir = Path(model)
        cfg_path = self.model_dir / "config.json"
        if not cfg_path.exists():
            raise ValueError(f"{self.model_dir}: not a Hugging Face checkpoint dir (no config.json)")
        self.hf_config = json.loads(cfg_path.read_text())
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.hf_config, self.device)
        model_module, runner_module = registry.resolve(self.hf_config)
        runner_cls = runner_module.Runner
        self.config = model_module.Config.from_hf(self.hf_config)
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size != 1:     # impossible sizes fail here, before any process starts
            from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
            check_tensor_parallel(model_module, self.hf_config, tensor_parallel_size, config=self.config)
        ctx_len = self.config.max_position_embeddings
        self.max_model_len = min(max_model_len or ctx_len, ctx_len)
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        # Whole prompts by default; enable_chunked_prefill=True prefills in chunks of max_num_batched_tokens.
        chunked = bool(enable_chunked_prefill)
        self.max_num_batched_tokens = max_num_batched_tokens or (8192 if chunked else max(8192, self.max_model_len))
        runner_kwargs = dict(device=self.device, dtype=self.dtype, block_size=block_size,
                             num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                             max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                             gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                             load_format=load_format, cuda_graph_sizes=cuda_graph_sizes, debug=debug)
        if tensor_parallel_size > 1:
            from xllm_gen.runtime.executor.tp import TensorParallelRunner
            self.runner = TensorParallelRunner(runner_cls, str(self.model_dir), self.hf_config,
                                               tensor_parallel_size, runner_kwargs)
        else:
            self.runner = runner_cls(str(self.model_dir), self.hf_config, **runner_kwargs)
        try:
            self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size)
            self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.max_num_batched_tokens, chunked)
            self.sampler = Sampler(seed)
            self.tokenizer = self._load_tokenizer()
            self.mm_processor = None
            if getattr(runner_cls, "multimodal", False):
                from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
                self.mm_processor = MultiModalProcessor(str(self.model_dir), self.hf_config)
            self.eos_token_ids = _eos_ids(self.model_dir, self.config, self.tokenizer)
        except BaseException:
            self.shutdown()              # stop TP ranks at once, not at garbage collection
            raise
        self.vocab_size = self.config.vocab_size
        self._next_id = 0
        self._requests: dict = {}            # request id -> Sequence (add_request / abort_request)
        self._request_of: dict = {}          # seq id -> request id
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}

    def _load_tokenizer(self):
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(str(self.model_dir))
        except Exception:      # a checkpoint without a tokenizer still serves prompt_token_ids
            return None

    # ---- admission ------------------------------------------------------------------------------
    def make_sequence(self, index: int, prompt: Any, params: SamplingParams) -> Sequence:
        """Validates one request; raises ValueError("request {index}: ...") when it cannot be served."""
        where = f"request {index}"
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        problems = params.problems()
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        text, mm_inputs = None, None
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
            if unknown:
                raise ValueError(f"{where}: unknown prompt key(s) {sorted(unknown)}")
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if (text is None) == (token_ids is None):
                raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
            mm_data = prompt.get("multi_modal_data")
            if mm_data:
                if self.mm_processor is None:
                    raise ValueError(f"{where}: multi_modal_data given, but this checkpoint is text-only")
                mm_inputs = self.mm_processor.process(index, text, token_ids, mm_data,
                                                      prompt.get("mm_processor_kwargs") or {})
                token_ids = list(mm_inputs.prompt_token_ids)
        else:
            raise ValueError(f"{where}: a prompt is a str or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"{where}: 'prompt' must be a string")
            if self.tokenizer is None:
                raise ValueError(f"{where}: text prompt, but the checkpoint has no tokenizer")
            token_ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in token_ids):
            raise ValueError(f"{where}: prompt_token_ids must be a list of ints")
        if len(token_ids) == 0:
            raise ValueError(f"{where}: empty prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} out of vocabulary (size {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"{where}: prompt of {len(token_ids)} tokens does not fit the model's context "
                             f"of {self.max_model_len} tokens (max_model_len)")
        if not self.scheduler.fits_at_all(len(token_ids) + 1):
            raise ValueError(f"{where}: prompt of {len(token_ids)} tokens needs more KV blocks than the cache "
                             f"holds ({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        if mm_inputs is None and self.mm_processor is not None:
            self.mm_processor.check_no_placeholders(index, token_ids)
        seq = Sequence(self._next_id, token_ids, params, prompt=text, mm_inputs=mm_inputs)
        self._next_id += 1
        return seq

    # ---- request-level API (what a server drives: add, step, abort) -----------------------------------
    def add_request(self, request_id: Any, prompt: Any, params: SamplingParams) -> None:
        """Queues one request; raises ValueError("request {request_id}: ...") when it cannot be served."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id}: a request with this id is already queued")
        seq = self.make_sequence(request_id, prompt, params)
        self._requests[request_id] = seq
        self._request_of[seq.seq_id] = request_id
        self.scheduler.add(seq)

    def step_outputs(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests that finished in it."""
        outs = []
        for seq in self.step():
            rid = self._request_of.pop(seq.seq_id, None)
            if rid is not None:
                self._requests.pop(rid, None)
                outs.append(self.output_of(rid, seq))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: Any) -> bool:
        """Drops a queued or running request and frees its KV blocks; False when it is unknown."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self._request_of.pop(seq.seq_id, None)
        self.scheduler.abort(seq)
        return True

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        seqs, is_prefill = self.scheduler.schedule()
        finished = self.scheduler.take_finished_by_capacity()
        if finished:
            logger.warning("%d request(s) outgrew the KV cache (%d blocks of %d tokens) and end with "
                           "finish_reason 'length'", len(finished), self.block_manager.num_blocks,
                           self.block_manager.block_size)
        if not seqs:
            if finished:
                return finished
            raise RuntimeError("scheduler made no progress: KV cache too small for any running request")
        logits = self.runner.run(seqs, is_prefill)
        self.stats["steps"] += 1
        ready = []       # sequences whose logits give a new token (prefill complete, or decode)
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens += seq.chunk_len
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(i)
        if is_prefill:
            self.stats["prefill_tokens"] += sum(s.chunk_len for s in seqs)
        else:
            self.stats["decode_tokens"] += len(seqs)
        if ready:
            ready_seqs = [seqs[i] for i in ready]
            logits = logits[ready]
            for row, seq in enumerate(ready_seqs):   # min_tokens: EOS and stop tokens are not allowed yet
                if seq.num_completion_tokens < seq.params.min_tokens:
                    banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
                    logits[row, [t for t in banned if 0 <= t < logits.shape[1]]] = float("-inf")
            tokens = self.sampler(logits, ready_seqs)
            for seq, tok in zip(ready_seqs, tokens):
                seq.append_token(tok)
                reason = self._finish_reason(seq, tok)
                if reason:
                    self.scheduler.finish(seq, reason)
                    finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            # a stop string ends in the newest token: decoding a short tail of the completion finds it
            window = max(len(s) for s in p.stop) + 4
            tail = self.decode_text(seq.completion_token_ids[-window:])
            if any(s in tail for s in p.stop):
                return "stop"
        if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def decode_text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def output_of(self, index: int, seq: Sequence) -> RequestOutput:
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.logprobs
            if self.tokenizer is not None:
                for entry in logprobs:
                    for tid, lp in entry.items():
                        lp.decoded_token = self.tokenizer.decode([tid])
        text = self.decode_text(seq.completion_token_ids)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if hits:                               # cut the text at the first stop string
            at, s = min(hits)
            text = text[:at + len(s)] if seq.params.include_stop_str_in_output else text[:at]
        comp = CompletionOutput(0, text, seq.completion_token_ids,
                                seq.finish_reason, logprobs,
                                seq.cumulative_logprob if seq.params.logprobs is not None else None)
        return RequestOutput(index, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], [comp], True, None)

    def shutdown(self) -> None:
        close = getattr(self.runner, "shutdown", None)
        if close:
            close()
