"""Speculative decoding: a proposer drafts up to k tokens per running sequence, the target model scores all of
them in one forward, and the engine commits the longest run the target agrees with, plus one token of its own.

Surface (vLLM's): `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 3})` or `{"method": "draft_model", "model": DIR,
"num_speculative_tokens": k}` (a smaller checkpoint of the same tokenizer, served by its own generated runner
and KV cache); the server takes the same dict as `--speculative-config JSON`.

Proposers:
- ngram (prompt lookup): the longest suffix of the sequence (prompt_lookup_max down to prompt_lookup_min tokens)
  that occurred earlier in it; the tokens that followed its latest earlier occurrence are the drafts. Its draft
  distribution q is one-hot.
- draft_model: the draft checkpoint decodes k tokens with the request's own sampling parameters (greedy rows:
  its argmax; sampled rows: a draw from its processed distribution q, kept for verification). Each running
  sequence has a shadow sequence in the draft's KV cache; after verification the shadow keeps the KV of its
  longest prefix that equals the committed tokens and recomputes the rest in its next catch-up prefill.

Verification: the step is a short prefill chunk of 1 + k_i tokens per sequence (its last committed token and its
drafts) against the paged cache (`runner.run(..., is_prefill=True, all_rows=True)`; on CUDA the piecewise
prefill graphs when the token count fits one, else eager). Row j of a sequence scores draft j+1. The rows are
then walked in order, each token appended through the engine's ordinary accept path (stop tokens and strings,
max_tokens, max_model_len, logprobs, grammars), so a run is cut exactly where non-speculative decoding stops:
- greedy rows: the row's token (argmax after the request's processing, grammar masks included) is emitted; the
  walk goes on while it equals the draft;
- sampled rows: exact rejection sampling (Leviathan et al. / Chen et al.): draft d is accepted with probability
  min(1, p(d) / q(d)); otherwise a token is drawn from norm(max(0, p - q)), and the walk stops. p is the
  request's processed distribution at that row (penalties and min_tokens see the tokens accepted before it), so
  the output distribution equals non-speculative sampling with the same parameters. An n-gram draft is one-hot
  (q = the draft), where this rule is the sampler's own draw from p with the draft kept iff it is that token: one
  draw per token emitted, so a seeded request gets the same tokens as without speculation, whatever drafts it
  got (free blocks, token budget, batch). A draft model's q is not one-hot: a seeded request gets the same
  distribution, not the same tokens (its drafts and checks consume the request's generator);
- after the last accepted draft, the next row gives one more token (the "bonus"), sampled as usual.
KV rollback: the target wrote KV for every draft; the sequence's computed tokens become its committed tokens
minus the last, so the slots of rejected drafts lie past it and are overwritten by the next step; blocks past
the committed length are given back, and only blocks full of committed tokens enter the prefix cache.

Not speculated (they decode one token per step, in the same batch): sampled rows with structured outputs (the
grammar decides p only per accepted prefix), and sequences with no room (max_tokens, max_model_len, KV blocks:
drafts only take free blocks, never preempt). Async scheduling is off while speculative decoding is on.
Multimodal runners and tensor-parallel draft models are refused at load.

Stats (engine.stats): spec_steps, spec_draft_tokens (drafts compared with the target's token; those after a stop
are not), spec_accepted_tokens, and the acceptance rate spec_accepted_tokens / spec_draft_tokens
(engine.spec_acceptance_rate, the server's stats line and /metrics)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from xllm_gen.runtime.engine.block_manager import BlockManager
from xllm_gen.runtime.engine.sampler import generator_of, greedy_argmax, nonfinite_error, process_row, row_probs
from xllm_gen.runtime.engine.sequence import Sequence

logger = logging.getLogger("xllm_gen")

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "num_kv_blocks"}
METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: Optional[str] = None
    num_kv_blocks: Optional[int] = None     # the draft model's KV blocks (default: load_draft_runner)

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """A dict (or its JSON text, as the server's --speculative-config takes it); None: no speculation.
        Errors name the key: `speculative_config: ...`."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        where = "speculative_config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: must be a dict, got {type(value).__name__}")
        unknown = sorted(set(map(str, value)) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method", "draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"{where}: 'method' must be one of {list(METHODS)}, got {method!r}")

        def int_of(key, default, low):
            v = value.get(key, default)
            if v is None and default is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{where}: {key!r} must be an integer >= {low}, got {v!r}")
            return v
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{where}: 'num_speculative_tokens' is required")
        k = int_of("num_speculative_tokens", None, 1)
        lo_given, hi_given = "prompt_lookup_min" in value, "prompt_lookup_max" in value
        lo = int_of("prompt_lookup_min", 1, 1)
        hi = int_of("prompt_lookup_max", max(3, lo), 1)
        if lo > hi:
            raise ValueError(f"{where}: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
        if method == "ngram" and ("model" in value or "num_kv_blocks" in value):
            raise ValueError(f"{where}: 'model' / 'num_kv_blocks' are for method 'draft_model', not 'ngram'")
        if method == "draft_model" and (lo_given or hi_given):
            raise ValueError(f"{where}: 'prompt_lookup_min' / 'prompt_lookup_max' are for method 'ngram'")
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"{where}: method 'draft_model' needs 'model': the draft checkpoint's directory")
        return cls(method, k, lo, hi, model, int_of("num_kv_blocks", None, 1))


# ---- proposers --------------------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: the drafts follow the latest earlier occurrence of the sequence's longest matching suffix."""

    def __init__(self, cfg: SpeculativeConfig):
        self.lo, self.hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        if k <= 0 or n_tok < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.hi, n_tok - 1), self.lo - 1, -1):
            pattern = arr[n_tok - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)   # starts 0 .. n_tok-1-n
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], Optional[list]]]:
        return [(self.propose_one(s.token_ids, k), None) for s, k in zip(seqs, ks)]

    def release(self, live_ids: set) -> None:
        pass

    def shutdown(self) -> None:
        pass


def check_target(cfg: Optional[SpeculativeConfig], runner_cls) -> None:
    """Refuses, before anything loads, a target speculative decoding does not serve."""
    if cfg is not None and getattr(runner_cls, "multimodal", False):
        raise ValueError("speculative_config: speculative decoding is not supported for multimodal models yet "
                         "(their decode positions come from the prompt's images)")
    model_module = getattr(runner_cls, "model_module", None)
    recurrent = getattr(model_module, "RECURRENT_LAYERS", ())
    if cfg is not None and recurrent:
        raise ValueError(f"speculative_config: speculative decoding is not supported for "
                         f"{getattr(model_module, 'SPEC', 'this model')}: its recurrent-state layers "
                         f"({', '.join(recurrent)}) update a per-sequence state with every token, which cannot be "
                         f"rolled back when drafts are rejected")


DRAFT_KV_SHARE = 0.25      # on a GPU, without num_kv_blocks: the draft's share of gpu_memory_utilization


def load_draft_runner(cfg: SpeculativeConfig, runner_kwargs: dict, tensor_parallel_size: int,
                      target_vocab_size: int) -> Optional[tuple]:
    """(runner, max_len) of the draft model of `cfg` (None for other methods), loaded before the target: on a GPU
    its KV cache takes DRAFT_KV_SHARE of gpu_memory_utilization (or num_kv_blocks) and the target the rest. A
    draft pool smaller than the target's only means fewer sequences get drafts. Refused by name: tensor
    parallelism, a multimodal draft, another vocabulary size."""
    if cfg is None or cfg.method != "draft_model":
        return None
    from xllm_gen.runtime.loading import registry
    from xllm_gen.runtime.loading.checkpoint_files import CheckpointFileError, read_config_json
    if tensor_parallel_size != 1:
        raise ValueError("speculative_config: a draft model runs at tensor_parallel_size 1 only; use method "
                         "'ngram' with tensor parallelism")
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: 'model' {cfg.model!r} is not a checkpoint directory (no config.json)")
    hf_config = read_config_json(path)
    model_module, runner_module = registry.resolve(hf_config)
    try:
        config = model_module.Config.from_hf(hf_config)
    except ValueError as e:
        raise CheckpointFileError(f"{path / 'config.json'}: {str(e).removeprefix('config.json: ')}") from None
    if getattr(runner_module.Runner, "multimodal", False):
        raise ValueError(f"speculative_config: the draft model {cfg.model} is multimodal; a draft model must be a "
                         "text decoder")
    if config.vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocab_size {config.vocab_size} "
                         f"({path / 'config.json'}) differs from the target's {target_vocab_size}; a draft model "
                         "must share the target's tokenizer and vocabulary")
    max_len = min(runner_kwargs["max_model_len"], config.max_position_embeddings)
    kw = dict(runner_kwargs, num_kv_blocks=cfg.num_kv_blocks, max_model_len=max_len)
    if torch.device(kw["device"]).type == "cuda" and cfg.num_kv_blocks is None:
        kw["gpu_memory_utilization"] = runner_kwargs["gpu_memory_utilization"] * DRAFT_KV_SHARE
    return runner_module.Runner(str(path), hf_config, **kw), max_len


class DraftModelProposer:
    """A draft checkpoint with its own generated runner and KV cache; one shadow sequence per target sequence."""

    def __init__(self, cfg: SpeculativeConfig, engine, draft: tuple):
        self.runner, self.max_len = draft
        self.block_manager = BlockManager(self.runner.num_kv_blocks, engine.block_manager.block_size,
                                          enable_caching=False)
        self.budget = engine.max_num_batched_tokens
        self.sampler_generator = engine.sampler.default_generator
        self.eos = engine.eos_token_ids
        self.shadows: dict[int, Sequence] = {}

    def shutdown(self) -> None:
        self.shadows.clear()
        self.runner.shutdown()

    def release(self, live_ids: set) -> None:
        """Frees the shadows of sequences that are no longer running."""
        for sid in [sid for sid in self.shadows if sid not in live_ids]:
            self.block_manager.free(self.shadows.pop(sid))

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = self.shadows[seq.seq_id] = Sequence(seq.seq_id, [], seq.params)
        old, new = sh.token_ids, seq.token_ids
        common = 0
        limit = min(len(old), len(new) - 1, sh.num_computed_tokens)    # the last token's logits are needed
        while common < limit and old[common] == new[common]:
            common += 1
        sh.token_ids = list(new)
        sh.num_computed_tokens = common        # KV of the longest prefix that still holds
        return sh

    def _draft_token(self, logits: torch.Tensor, sh: Sequence, seq: Sequence) -> tuple[int, Optional[torch.Tensor]]:
        p = seq.params
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos))
        if p.greedy:
            row = process_row(logits, sh, banned) if (p.needs_processing or sh.num_completion_tokens < p.min_tokens) \
                else logits
            return int(torch.argmax(row).item()), None
        q = row_probs(process_row(logits, sh, banned), sh)
        gen = generator_of(seq, self.sampler_generator)          # the request's own stream when it is seeded
        return int(torch.multinomial(q, 1, generator=gen).item()), q

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], Optional[list]]]:
        out: list[tuple[list[int], Optional[list]]] = [([], None) for _ in seqs]
        act = []                                  # (index, seq, shadow, k)
        bm = self.block_manager
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            k = min(k, self.max_len - seq.num_tokens)
            if k <= 0:
                continue
            sh = self._shadow(seq)
            sh.num_prompt_tokens = seq.num_prompt_tokens
            need = seq.num_tokens + k - 1                  # KV of the tokens and of drafts 1..k-1
            if not bm.can_allocate(sh, need):
                bm.free(sh)
                self.shadows.pop(seq.seq_id, None)
                continue
            bm.allocate(sh, need)
            act.append((i, seq, sh, k))
        if not act:
            return out
        # catch-up: prefill every shadow up to the sequence's last token (in chunks of the token budget)
        last_logits: dict[int, torch.Tensor] = {}
        pending = list(act)
        while pending:
            batch, budget = [], self.budget
            for item in pending:
                sh = item[2]
                n = min(sh.num_tokens - sh.num_computed_tokens, budget)
                if n <= 0:
                    break
                sh.chunk_len = n
                budget -= n
                batch.append(item)
            logits = self.runner.run([it[2] for it in batch], True)
            for (i, seq, sh, k), row in zip(batch, logits):
                sh.num_computed_tokens += sh.chunk_len
                if sh.num_computed_tokens == sh.num_tokens:
                    last_logits[i] = row
            pending = [it for it in pending if it[2].num_computed_tokens < it[2].num_tokens]
        drafts = {i: [] for i, *_ in act}
        qs = {i: [] for i, *_ in act}
        live = list(act)
        for j in range(max(k for *_, k in act)):
            if j:
                logits = self.runner.run([it[2] for it in live], False)
                for (i, seq, sh, k), row in zip(live, logits):
                    sh.num_computed_tokens += 1
                    last_logits[i] = row
            stacked = torch.stack([last_logits[it[0]] for it in live])
            argmax = stacked.argmax(dim=-1).tolist()           # one device-to-host copy for the plain greedy rows
            for row, (i, seq, sh, k) in enumerate(live):
                p = seq.params
                if p.greedy and not p.needs_processing and sh.num_completion_tokens >= p.min_tokens:
                    tok, q = argmax[row], None
                else:
                    tok, q = self._draft_token(stacked[row].float().cpu(), sh, seq)
                drafts[i].append(tok)
                qs[i].append(q)
                sh.token_ids.append(tok)
            live = [it for it in live if len(drafts[it[0]]) < it[3]]
            if not live:
                break
        for i, seq, sh, k in act:
            out[i] = (drafts[i], None if seq.params.greedy else qs[i])
        return out


# ---- verification -------------------------------------------------------------------------------------------
def acceptance_probability(p_draft: float, q_draft: float) -> float:
    """Rejection sampling's acceptance of a draft token: min(1, p(d) / q(d)) (tests replace it with a biased rule
    and require the distribution test to fail)."""
    return 1.0 if q_draft <= 0.0 else min(1.0, p_draft / q_draft)


class SpecDecoder:
    """The engine's speculative decode step (see the module docstring)."""

    def __init__(self, cfg: SpeculativeConfig, engine, draft: Optional[tuple] = None):
        self.cfg = cfg
        self.engine = engine
        self.proposer = NgramProposer(cfg) if cfg.method == "ngram" else DraftModelProposer(cfg, engine, draft)

    def shutdown(self) -> None:
        self.proposer.shutdown()

    def _room(self, seq: Sequence) -> int:
        """How many drafts the sequence can use: one token is always the target's own."""
        p = seq.params
        if seq.error or (seq.grammar is not None and not p.greedy):
            return 0
        eng = self.engine
        return max(0, min(self.cfg.num_speculative_tokens, p.max_tokens - seq.num_completion_tokens - 1,
                          eng.max_model_len - seq.num_tokens - 1))

    def step(self, seqs: list[Sequence], finished: list[Sequence]) -> bool:
        """One decode step of `seqs` (their KV slot for the last token allocated by the scheduler) with drafts
        verified; False (nothing done) when no sequence got a draft: the caller decodes as usual."""
        eng = self.engine
        bm = eng.block_manager
        self.proposer.release({s.seq_id for q in (eng.scheduler.running, eng.scheduler.waiting) for s in q})
        proposals = self.proposer.propose(seqs, [self._room(s) for s in seqs])
        budget = eng.max_num_batched_tokens - len(seqs)
        plan = []
        for seq, (drafts, qs) in zip(seqs, proposals):
            drafts = drafts[:max(0, min(len(drafts), self._room(seq), budget))]
            while drafts and not bm.can_allocate(seq, seq.num_tokens + len(drafts)):
                drafts = drafts[:-1]                     # drafts take free blocks only, never preempt
            bm.allocate(seq, seq.num_tokens + len(drafts))
            budget -= len(drafts)
            plan.append((drafts, qs))
        if not any(d for d, _ in plan):
            return False
        base = [s.num_tokens for s in seqs]
        for seq, (drafts, _) in zip(seqs, plan):
            seq.token_ids.extend(drafts)                 # the verification's inputs: last token + drafts
            seq.chunk_len = 1 + len(drafts)              # num_computed_tokens == base - 1
        try:
            rows = eng.runner.run(seqs, True, all_rows=True)
        finally:
            rollback = getattr(eng.runner, "rollback_tokens", None)     # tensor parallelism: the ranks' copies
            for seq, n in zip(seqs, base):
                del seq.token_ids[n:]
                if rollback is not None:
                    rollback(seq.seq_id, n)
        st = eng.stats
        st["steps"] += 1
        st["spec_steps"] += 1
        greedy_tokens = greedy_argmax(rows)[1].tolist()      # -1: a row whose logits are not finite
        off = 0
        for seq, (drafts, qs) in zip(seqs, plan):
            n_rows = 1 + len(drafts)
            emitted = 0
            for j in range(n_rows):
                draft = drafts[j] if j < len(drafts) else None
                try:
                    tok = self._token(rows[off + j], greedy_tokens[off + j], seq, draft,
                                      qs[j] if qs is not None and draft is not None else None)
                except Exception as e:                   # this request fails alone
                    logger.exception("speculative verification failed for sequence %s", seq.seq_id)
                    seq.error, tok = f"sampling failed: {type(e).__name__}: {e}", None
                if tok is None:
                    break
                if draft is not None:
                    st["spec_draft_tokens"] += 1         # drafts compared (those after a stop are not)
                eng._accept([seq], [tok], finished)
                emitted += 1
                if tok != draft:
                    break
                st["spec_accepted_tokens"] += 1
                if seq.is_finished or seq.error:
                    break
            st["decode_tokens"] += emitted
            off += n_rows
            if not seq.is_finished and not seq.error:
                seq.num_computed_tokens = seq.num_tokens - 1   # the KV of rejected drafts lies past this
                bm.commit(seq)                                 # blocks full of committed tokens only
                bm.trim(seq, seq.num_tokens)         # blocks held for rejected drafts go back
        eng._fail_errored(seqs, finished)
        return True

    def _token(self, logits: torch.Tensor, argmax: int, seq: Sequence, draft: Optional[int],
               q: Optional[torch.Tensor]) -> Optional[int]:
        """The token row `logits` gives `seq` (whose state holds every token accepted before this row): greedy and
        the bonus row as the sampler decides; a sampled row with a draft by rejection sampling."""
        eng = self.engine
        p = seq.params
        if argmax < 0:                                  # non-finite logits: the request fails alone
            seq.error = nonfinite_error(seq.num_completion_tokens)
            return None
        if p.greedy and not p.needs_processing and p.logprobs is None and seq.grammar is None \
                and seq.num_completion_tokens >= p.min_tokens:
            return argmax
        if draft is None or p.greedy or q is None:
            # the sampler's own token; the walk keeps the draft iff it is that token. For an n-gram draft (q one-hot
            # at d) this IS rejection sampling: d kept with probability p(d), otherwise a token drawn from p without
            # d. It takes one draw from the request's generator per token emitted, as decoding without drafts does,
            # so a seeded request's tokens do not depend on how many drafts it got (free blocks, token budget, the
            # batch around it) and equal those of the engine without speculation
            return eng.sampler(logits[None], [seq], eng.eos_token_ids)[0]
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eng.eos_token_ids))
        probs = row_probs(process_row(logits.float().cpu(), seq, banned), seq)
        gen = generator_of(seq, eng.sampler.default_generator)
        u = float(torch.rand((), generator=gen))
        if u < acceptance_probability(float(probs[draft]), float(q[draft])):
            tok = draft
        else:
            resid = (probs - q).clamp(min=0.0)
            if float(resid.sum()) <= 0.0:                # p == q: the draft is always accepted; never here
                resid = probs
            tok = int(torch.multinomial(resid / resid.sum(), 1, generator=gen).item())
        eng.sampler._record_logprobs(logits[None], [seq], [tok])
        return tok
