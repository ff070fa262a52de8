"""What `xllm-gen verify` compares (codegen/verify.py runs the models): log-probability rows (prompt and decode
steps), layer errors, 16-bit yardsticks and near-ties, and what a run cannot exercise."""
from __future__ import annotations

from pathlib import Path

from .verify_report import LOGPROB_TOP, VerifyError


def logprob_row_error(entries: dict, ref_row) -> float:
    """Max |engine - reference| log-probability over the engine's entries of one position ({token id: Logprob}),
    against the reference's log_softmax row; a NaN on either side is no agreement (inf). Shared with the
    batteries (tests/test_spec_battery.py Tokens)."""
    e = max(abs(float(lp.logprob) - float(ref_row[t])) for t, lp in entries.items())
    return float("inf") if e != e else e


def _logprob_error(hf_logits, out, tol: float, skip=None) -> tuple[float, int | None]:
    """(max |engine - transformers| log-probability, first position over `tol`) over the engine's entries: per
    position p >= 1 of the prompt the distribution of its token given the tokens before (prompt_logprobs), and the
    next token's after the last (logprobs); transformers' from log_softmax of its logits in float32. `skip` [len]
    bool: positions whose distribution is not compared (MoE routing ties, verify_routing)."""
    import torch
    ref = torch.log_softmax(hf_logits.float(), dim=-1)
    rows = [(p, d) for p, d in enumerate(out.prompt_logprobs or []) if d]       # position p: given tokens < p
    rows += [(len(ref), d) for d in (out.outputs[0].logprobs or [])[:1] if d]
    err, bad = 0.0, None
    for p, entries in rows:
        if skip is not None and skip[p - 1]:
            continue
        want = ref[p - 1]
        e = logprob_row_error(entries, want)
        err = max(err, e)
        if bad is None and e > tol:
            bad = p
    return err, bad


def _step_logprob_error(hf_logits, prompt_len: int, want: list, got, tol: float,
                        skip=None) -> tuple[float, int | None]:
    """(max error, first step over `tol`) of the engine's per-step log-probabilities of its greedy decode steps
    against transformers' teacher-forced distributions at the same positions: step i is compared while the tokens
    before it agree (the reference row is the distribution given the prompt and want[:i]). The prefill's
    log-probabilities (prompt_logprobs) exercise the prefill path; these exercise the decode path."""
    import torch
    ref = torch.log_softmax(hf_logits.float(), dim=-1)
    err, bad = 0.0, None
    for i, entries in enumerate(got.logprobs or []):
        row = prompt_len - 1 + i
        if row >= len(ref) or list(got.token_ids[:i]) != want[:i] or not entries:
            break
        if skip is not None and skip[row]:
            continue
        e = logprob_row_error(entries, ref[row])
        err = max(err, e)
        if bad is None and e > tol:
            bad = i
    return err, bad


def _rel_error(b, a) -> float:
    """max |b - a| relative to max |a| (hidden states of one layer, float32)."""
    a = a.double()
    return float((b.double() - a).abs().max() / a.abs().max().clamp_min(1e-12))


def _own_logprob_error(logits32, logits16) -> float:
    """transformers' own 16-bit error: max |log_softmax(16-bit) - log_softmax(float32)| over each position's top
    LOGPROB_TOP tokens of the float32 run (what the engine's entries are compared on)."""
    import torch
    lp32 = torch.log_softmax(logits32.double(), dim=-1)
    lp16 = torch.log_softmax(logits16.double(), dim=-1)
    top = lp32.topk(LOGPROB_TOP, dim=-1).indices
    return float((lp16.gather(-1, top) - lp32.gather(-1, top)).abs().max())


def _first_diff(want: list, got: list) -> int | None:
    """The first step where two greedy continuations differ (None: they agree where both have tokens)."""
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)


def _follows_own_forward(row_logits, want: list, got: list):
    """Where the engine's greedy tokens first differ from transformers' generate (cached), whether the engine follows
    transformers' own uncached forward from there: at every step k from the first difference d, the engine's token
    is the argmax of transformers' logits given the prompt and the engine's got[:k] (row_logits(k, got[:k])), and
    at d that argmax is not generate's token. Then transformers' cache computes something else than its own forward
    (a sliding window of 1 token, a clamp its prompt pass applies and its decode step does not), and the engine,
    which the teacher-forced comparison checks against that forward, is not what differs: returns (d, generate's
    token, the forward's token); else None."""
    d = _first_diff(want, got)
    if d is None:
        return None
    for k in range(d, len(got)):
        if int(row_logits(k, got[:k]).argmax()) != got[k]:
            return None
    return d, want[d], got[d]


def _near_tie(row_logits, want: list, got: list, bound: float):
    """16-bit: where the engine's greedy tokens first differ from float32 transformers', (step, margin, bound) when
    float32's margin between its token and the engine's is below `bound` (a near-tie, within 16-bit noise); else
    None (a real difference, or none). row_logits(d): float32 logits of step d given the prompt and want[:d]."""
    import torch
    d = _first_diff(want, got)
    if d is None:
        return None
    lp = torch.log_softmax(row_logits(d).float(), dim=-1)
    margin = float(lp[want[d]] - lp[got[d]])
    return (d, margin, bound) if margin < bound else None


WEAK_GAIN = 0.5     # a weight matrix's std x sqrt(fan_in) below which activations fade layer after layer


def weak_weights_note(hf_model) -> list:
    """A tiny checkpoint left at transformers' random init (std 0.02 at a width of 64: std x sqrt(fan_in) ~0.16)
    keeps every activation near 0, where the nonlinearities nearly agree (erf and tanh GELU within ~1e-6 of each
    other there): a spec with the wrong one passes. Real weights have a gain near 1; say so where the median matrix's
    is far below it (a blind exercise's erf-for-tanh GELU passed on such a checkpoint, failed at x8 weights)."""
    import torch
    gains = [float(p.detach().float().std() * p.shape[-1] ** 0.5) for n, p in hf_model.named_parameters()
             if p.dim() == 2 and min(p.shape) > 1 and "embed" not in n and "lm_head" not in n]
    if not gains:
        return []
    median = float(torch.tensor(gains).median())
    if median >= WEAK_GAIN:
        return []
    return [f"weak weights: the median weight matrix has std x sqrt(fan_in) = {median:.2f} (transformers' random init "
            f"at a small width): activations stay near 0, where activation functions nearly agree (erf vs tanh GELU), "
            f"so a wrong one can pass; re-initialize wider (N(0, 1 / fan_in) per matrix) or verify real weights"]


LOADED_CHECK_MAX_BYTES = 2 << 30      # checkpoints up to this size are read back for loaded_weights_note


def loaded_weights_note(hf_model, ckpt) -> list:
    """transformers' model after from_pretrained against the checkpoint's own files: a tensor of the same name and
    shape that it holds with other values was changed by its loading (an initialization step that runs on loaded
    weights, e.g. Mamba's rescale_prenorm_residual dividing out_proj by sqrt(layers) in transformers 5.25), so the
    reference is not the file's model; say which, where a comparison then fails the cause is there, not in the
    spec (the engine serves the file's values)."""
    import torch
    from safetensors import safe_open
    files = sorted(Path(ckpt).glob("*.safetensors"))
    if sum(f.stat().st_size for f in files) > LOADED_CHECK_MAX_BYTES:     # a real model: reading it twice costs
        return []
    held = dict(hf_model.state_dict())
    changed = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                mine = held.get(name)
                if mine is None or tuple(mine.shape) != tuple(st.get_slice(name).get_shape()):
                    continue
                want = st.get_tensor(name)
                if not want.is_floating_point():
                    continue
                want, mine = want.float(), mine.detach().float().cpu()
                if want.numel() and not torch.allclose(mine, want, rtol=1e-2, atol=1e-6 * float(want.abs().max())):
                    ratio = float(want.abs().max() / mine.abs().max().clamp_min(1e-30))
                    changed.append(f"{name} (max |value| {ratio:.4g}x its loaded one)")
    if not changed:
        return []
    return [f"transformers holds {len(changed)} tensor(s) with other values than the checkpoint's files after loading "
            f"(its loading changed them: an initialization run on loaded weights, a conversion): "
            f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; the engine serves the files' values, so a "
            f"difference from here on is transformers' loading, not the spec: find the config field behind it (the "
            f"spec may refuse it by config_assume)"]


def missing_weights_note(hf_model, info) -> list:
    """Tensors transformers found nowhere in the checkpoint (from_pretrained's missing keys, less a tied head): it
    left them at random init, so the reference is not the checkpoint's model (a name only the original release
    uses, e.g. mamba_ssm's backbone.embedding, which transformers 5.25 does not rename at load)."""
    tied = set(getattr(hf_model, "all_tied_weights_keys", {}) or ())
    missing = sorted(k for k in (info or {}).get("missing_keys", ()) if k not in tied)
    if not missing:
        return []
    return [f"transformers did not find {len(missing)} tensor(s) of its model in the checkpoint and left them at "
            f"random init: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (the checkpoint's names: "
            f"{', '.join(sorted((info or {}).get('unexpected_keys', ()))[:4]) or 'none left over'}): it is not the "
            f"checkpoint's model, so a difference from here on is the reference's"]


def _unexercised(model, longest: int) -> list:
    """Attention windows / chunks this run's sequences (at most `longest` tokens) never reach: a wrong window size or
    pattern passes such a run; say so, with what would exercise it."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    spans = {}
    for m in model.modules():
        v = getattr(m, "variant", None)
        if isinstance(v, AttentionVariant):
            for what, size in (("sliding window", v.sliding_window), ("attention chunk", v.chunk_size)):
                if size is not None and size >= longest:
                    spans.setdefault(what, set()).add(size)
    notes = [f"{what} {', '.join(map(str, sorted(sizes)))} not exercised: the longest sequence is {longest} tokens "
             f"(--prompt-lens beyond it, or a checkpoint with a smaller {what.split()[-1]}, would test it)"
             for what, sizes in spans.items()]
    # longrope: this run's context (its longest sequence) keeps short_factor; a deployment whose max_model_len passes
    # the original context (the default, max_position_embeddings) takes long_factor at every position
    originals = {int(m.scaling.get("original_max_position_embeddings", m.max_position)) for m in model.modules()
                 if callable(getattr(m, "long_regime_differs", None)) and m.long_regime_differs()}
    notes += [f"longrope's long-context regime (long_factor / long_mscale) not exercised: the longest sequence is "
              f"{longest} tokens, within the original context {o}; served with max_model_len above {o} (the default: "
              f"max_position_embeddings) every position takes it (transformers: only sequences past {o}); "
              f"--prompt-lens beyond {o} test it"
              for o in sorted(originals) if longest <= o]
    return notes


def _reference(run, cls, checkpoint):
    """transformers' side of a comparison: where its own forward fails on this checkpoint (a config its modeling
    code cannot run), say so; the spec is not what failed and there is nothing to compare with."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - any failure of the reference model
        import transformers
        raise VerifyError(f"{checkpoint}: the transformers reference failed: {cls.__name__} (transformers "
                          f"{transformers.__version__}) raised {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}; there is nothing to compare with (the config "
                          f"may be one transformers cannot run)") from None
