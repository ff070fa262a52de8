"""`xllm-gen verify SPEC CHECKPOINT_DIR`: is this spec right for this checkpoint? The battery's parity check on
any local checkpoint (tiny or real), with the first divergence located.

1. The spec is compiled into a temporary directory and imported from there (the engine is pointed at that
   package for the checkpoint's architecture; the shipped generated/ is not touched nor consulted).
2. The checkpoint is loaded in transformers (its own `architectures[0]` class, eager attention) and in the
   engine (prefix caching off, eager), both on `device` in `dtype` (float32 on CPU by default).
3. Greedy: a few prompts of random token ids (fixed seed; lengths `prompt_lens`), `max_tokens` new tokens each,
   EOS ignored on both sides; the first differing token is reported (prompt, step).
4. Teacher-forced: each prompt followed by transformers' greedy continuation is run once through both models
   with forward hooks on the decoder layers (transformers: the ModuleList of `num_hidden_layers` layers;
   engine: the generated decoder's `layers`, whose output (hidden, residual) is the residual stream
   hidden + residual). Per layer: the max |engine - transformers| over positions and features, relative to
   the layer's max |transformers| value; the first layer over the tolerance is the first divergence, reported
   with its first position over it.
5. The same teacher-forced run compares the output distribution: the engine's log-probabilities (its top
   `LOGPROB_TOP` per position and the next token's, prompt_logprobs + logprobs) against transformers'
   log_softmax of its logits, max absolute difference. What comes after the last layer (final norm, lm_head,
   logit scales and soft-caps) can keep every argmax and still change every probability a sampler draws from.
6. The greedy run's decode steps return their log-probabilities too, compared with the teacher-forced rows of the
   same positions while the tokens agree: the decode path (paged attention over the cache) can keep the argmax
   and still differ from the prefill path that 4 and 5 exercise.
Exit status (cli): 0 when the tokens agree and every layer and the log-probabilities are within the tolerance, 1
otherwise.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from .compiler import compile_spec
from .writer import write


class VerifyError(Exception):
    """The check could not run (bad checkpoint, architecture not claimed by the spec, ...)."""


DEFAULT_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}    # absolute, in nats
LOGPROB_TOP = 5
YARDSTICK = 3          # 16-bit: the engine's error may be this many times transformers' own (GPU spec tests' bound)
NEAR_TIE = 0.02        # 16-bit: the least float32 log-probability margin of a differing greedy token that is a tie


@dataclasses.dataclass
class LayerError:
    layer: int
    max_rel: float                 # max |engine - hf| / max |hf| over positions and features
    max_abs: float
    first_bad_position: int | None  # first position over the tolerance (None: within)


@dataclasses.dataclass
class PromptResult:
    prompt_len: int
    hf_tokens: list
    engine_tokens: list
    layers: list                   # [LayerError] teacher-forced over prompt + hf continuation
    logprob_err: float = 0.0       # max |engine - hf| log-probability over the compared entries
    logprob_bad_position: int | None = None   # first position over LOGPROB_TOL (None: within)
    step_logprob_err: float = 0.0  # the same over the greedy decode steps (while the tokens agree)
    step_logprob_bad: int | None = None       # first decode step over LOGPROB_TOL (None: within)
    near_tie: tuple | None = None  # 16-bit: (step, float32 margin, bound) of a first differing token at a near-tie

    @property
    def first_token_diff(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.hf_tokens, self.engine_tokens)):
            if a != b:
                return i
        return None if len(self.hf_tokens) == len(self.engine_tokens) else min(len(self.hf_tokens),
                                                                                 len(self.engine_tokens))


@dataclasses.dataclass
class Report:
    spec: str
    checkpoint: str
    architecture: str
    dtype: str
    tol: float
    refused: str | None = None
    prompts: list = dataclasses.field(default_factory=list)
    defaults: list = dataclasses.field(default_factory=list)   # absent / null fields read unlike transformers
    reference: str = ""            # the transformers class compared with (a note where model_type chose it)
    tp: int = 1                    # the engine's tensor parallel size
    defaults_checked: str = ""     # the config class the defaults were checked against ("" : not checked)
    notes: list = dataclasses.field(default_factory=list)   # what this run could not exercise (never a failure)

    @property
    def ok(self) -> bool:
        return self.refused is None and not self.defaults and all(
            (p.first_token_diff is None or p.near_tie is not None) and p.logprob_bad_position is None
            and p.step_logprob_bad is None
            and all(e.first_bad_position is None for e in p.layers) for p in self.prompts)

    def first_divergence(self) -> tuple[int, PromptResult, LayerError] | None:
        """(prompt index, prompt, layer error) of the earliest layer over the tolerance over all prompts."""
        best = None
        for i, p in enumerate(self.prompts):
            for e in p.layers:
                if e.first_bad_position is not None:
                    if best is None or (e.layer, e.first_bad_position) < (best[2].layer, best[2].first_bad_position):
                        best = (i, p, e)
                    break
        return best

    def text(self) -> str:
        head = (f"verify {self.spec} on {self.checkpoint} ({self.architecture}, {self.dtype}"
                + (f", TP {self.tp}" if self.tp > 1 else "") + f", tolerance {self.tol:g})")
        if self.refused:
            return f"{head}\nREFUSED by {self.refused}\nFAIL"
        lines = [head] + ([self.reference] if self.reference else [])
        lines += [f"default DIFFERS: {d}" for d in self.defaults]
        if self.defaults_checked and not self.defaults:
            lines.append(f"defaults: the fields read absent and null agree with {self.defaults_checked}")
        lines += [f"note: {n}" for n in self.notes]
        n_layers = len(self.prompts[0].layers) if self.prompts else 0
        worst = [max((p.layers[l].max_rel for p in self.prompts), default=0.0) for l in range(n_layers)]
        lines.append("per-layer max relative error (teacher-forced, all prompts): "
                     + " ".join(f"{l}:{w:.1e}" for l, w in enumerate(worst)))
        for i, p in enumerate(self.prompts):
            d = p.first_token_diff
            lines.append(f"prompt {i} ({p.prompt_len} tokens): greedy tokens "
                         + ("agree" if d is None else
                            f"differ at a near-tie from step {d} (float32 margin {p.near_tie[1]:.3f} < "
                            f"{p.near_tie[2]:.3f}, within transformers' own {self.dtype} noise)" if p.near_tie else
                            f"DIFFER at step {d}: engine {p.engine_tokens[d:d + 4]} vs transformers {p.hf_tokens[d:d + 4]}")
                         + f"; log-probabilities max error {p.logprob_err:.1e}"
                         + ("" if p.logprob_bad_position is None else
                            f" DIFFER from position {p.logprob_bad_position} (> {LOGPROB_TOL[self.dtype]:g}"
                            + ("" if any(e.first_bad_position is not None for e in p.layers) else
                               ": every layer agrees, so after the last layer: final norm, lm_head, logit scale / "
                               "soft-cap") + ")")
                         + f"; decode steps' log-probabilities max error {p.step_logprob_err:.1e}"
                         + ("" if p.step_logprob_bad is None else
                            f" DIFFER from step {p.step_logprob_bad} (> {LOGPROB_TOL[self.dtype]:g}: the decode path "
                            f"(paged attention over the cache, decode-only kernels), since the prefill's agree)"
                            if p.logprob_bad_position is None else
                            f" DIFFER from step {p.step_logprob_bad}"))
        first = self.first_divergence()
        if first is not None:
            i, p, e = first
            lines.append(f"first divergence: layer {e.layer}, position {e.first_bad_position} (prompt {i}, "
                         f"{p.prompt_len} prompt tokens + continuation): max error {e.max_abs:.3e} "
                         f"(relative {e.max_rel:.3e} > {self.tol:g})")
        lines.append("OK" if self.ok else "FAIL")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the package
def _import_compiled(files: dict, name: str, tmp: Path):
    """Write the rendered files to tmp/<name>/ and import them as a fresh package."""
    directory = tmp / name
    write(files, directory)
    pkg_name = f"xllm_gen_verify_{name}"
    for mod in [m for m in sys.modules if m == pkg_name or m.startswith(pkg_name + ".")]:
        del sys.modules[mod]
    spec = importlib.util.spec_from_file_location(pkg_name, directory / "__init__.py",
                                                  submodule_search_locations=[str(directory)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[pkg_name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{pkg_name}.model"), importlib.import_module(f"{pkg_name}.runner")


@contextlib.contextmanager
def _served_by(model_module, runner_module, tmp: Path, name: str, tp: int):
    """Inside: the engine serves every checkpoint with these modules. At TP 1 the registry is bypassed; at TP > 1
    the rank processes import the runner by name, so the package is found as a user's generated/ directory
    (XLLM_GEN_PATH = tmp, preferred over a shipped package of the same architectures), which the workers inherit."""
    import os

    from xllm_gen.runtime.loading import registry
    if tp == 1:
        orig = registry.resolve
        registry.resolve = lambda hf_config: (model_module, runner_module)
        try:
            yield
        finally:
            registry.resolve = orig
        return
    package = f"{registry._USER_PKG}.{name}"
    saved = {k: os.environ.get(k) for k in (registry.SEARCH_PATH_ENV, registry.PREFER_ENV)}
    os.environ[registry.SEARCH_PATH_ENV] = os.pathsep.join([str(tmp)] + [d for d in [saved[registry.SEARCH_PATH_ENV]] if d])
    os.environ[registry.PREFER_ENV] = os.pathsep.join([package] + [d for d in [saved[registry.PREFER_ENV]] if d])
    stale = [m for m in sys.modules if m == package or m.startswith(package + ".")]
    for m in stale:                    # an earlier verify's package of the same name (another temporary directory)
        del sys.modules[m]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for m in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[m]


def _decoder_layers(model, n_layers: int):
    """The decoder layers of `model`: the ModuleList of `n_layers` modules, preferring one named `*layers` outside
    a vision tower."""
    import torch.nn as nn
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    found.sort(key=lambda nm: (not nm[0].endswith("layers"), "vis" in nm[0]))
    if not found:
        raise VerifyError(f"no list of {n_layers} decoder layers found in {type(model).__name__}")
    return list(found[0][1])


class _Recorder:
    """Forward hooks on decoder layers: the residual stream after each layer, of the first forward call."""

    def __init__(self, layers, engine: bool):
        self.engine = engine
        self.out: dict[int, Any] = {}
        self.armed = False
        self.handles = [l.register_forward_hook(self._hook(i)) for i, l in enumerate(layers)]

    def _hook(self, i):
        def hook(module, args, output):
            if not self.armed or i in self.out:
                return
            if isinstance(output, (tuple, list)):      # (a list: transformers' GPT-1 blocks return [h, ...])
                h = output[0]
                if self.engine and len(output) > 1 and output[1] is not None:
                    h = h + output[1]        # the generated layers return (hidden, running residual)
            else:
                h = output
            scale = getattr(module, "stream_scale", 1.0) if self.engine else 1.0
            if scale != 1.0:
                # a layer that scales the whole stream after itself (layers.stream_scale) does so where transformers
                # scales it outside its block, after the block's hook: compare the stream before that scale (the
                # next layer's state compares the scaled one)
                h = h / scale
            self.out[i] = h.detach().float().reshape(-1, h.shape[-1]).cpu()
        return hook

    def arm(self):
        self.out, self.armed = {}, True

    def take(self) -> list:
        self.armed = False
        return [self.out[i] for i in sorted(self.out)]

    def remove(self):
        for h in self.handles:
            h.remove()


def _ordinary_token_ids(ckpt: Path, vocab: int):
    """Token ids a prompt may hold: the vocabulary without the tokenizer's special and added tokens (an image
    placeholder in a text prompt is an invalid request); all ids when the checkpoint has no tokenizer."""
    import numpy as np
    ids = np.arange(vocab)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(ckpt))
    except Exception:
        return ids
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    keep = ids[~np.isin(ids, sorted(special))]
    return keep[keep < len(tok)] if len(keep[keep < len(tok)]) else keep


def logprob_row_error(entries: dict, ref_row) -> float:
    """Max |engine - reference| log-probability over the engine's entries of one position ({token id: Logprob}),
    against the reference's log_softmax row; a NaN on either side is no agreement (inf). Shared with the
    batteries (tests/test_spec_battery.py Tokens)."""
    e = max(abs(float(lp.logprob) - float(ref_row[t])) for t, lp in entries.items())
    return float("inf") if e != e else e


def _logprob_error(hf_logits, out, tol: float) -> tuple[float, int | None]:
    """(max |engine - transformers| log-probability, first position over `tol`) over the engine's entries: per
    position p >= 1 of the prompt the distribution of its token given the tokens before (prompt_logprobs), and the
    next token's after the last (logprobs); transformers' from log_softmax of its logits in float32."""
    import torch
    ref = torch.log_softmax(hf_logits.float(), dim=-1)
    rows = [(p, d) for p, d in enumerate(out.prompt_logprobs or []) if d]       # position p: given tokens < p
    rows += [(len(ref), d) for d in (out.outputs[0].logprobs or [])[:1] if d]
    err, bad = 0.0, None
    for p, entries in rows:
        want = ref[p - 1]
        e = logprob_row_error(entries, want)
        err = max(err, e)
        if bad is None and e > tol:
            bad = p
    return err, bad


def _step_logprob_error(hf_logits, prompt_len: int, want: list, got, tol: float) -> tuple[float, int | None]:
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
        e = logprob_row_error(entries, ref[row])
        err = max(err, e)
        if bad is None and e > tol:
            bad = i
    return err, bad


def _rel_error(b, a) -> float:
    """max |b - a| relative to max |a| (hidden states of one layer, float32)."""
    a = a.float()
    return float((b.float() - a).abs().max() / a.abs().max().clamp_min(1e-12))


def _own_logprob_error(logits32, logits16) -> float:
    """transformers' own 16-bit error: max |log_softmax(16-bit) - log_softmax(float32)| over each position's top
    LOGPROB_TOP tokens of the float32 run (what the engine's entries are compared on)."""
    import torch
    lp32 = torch.log_softmax(logits32.float(), dim=-1)
    lp16 = torch.log_softmax(logits16.float(), dim=-1)
    top = lp32.topk(LOGPROB_TOP, dim=-1).indices
    return float((lp16.gather(-1, top) - lp32.gather(-1, top)).abs().max())


def _near_tie(row_logits, want: list, got: list, bound: float):
    """16-bit: where the engine's greedy tokens first differ from float32 transformers', (step, margin, bound) when
    float32's margin between its token and the engine's is below `bound` (a near-tie, within 16-bit noise); else
    None (a real difference, or none). row_logits(d): float32 logits of step d given the prompt and want[:d]."""
    import torch
    d = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if d is None:
        return None
    lp = torch.log_softmax(row_logits(d).float(), dim=-1)
    margin = float(lp[want[d]] - lp[got[d]])
    return (d, margin, bound) if margin < bound else None


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
    return [f"{what} {', '.join(map(str, sorted(sizes)))} not exercised: the longest sequence is {longest} tokens "
            f"(--prompt-lens beyond it, or a checkpoint with a smaller {what.split()[-1]}, would test it)"
            for what, sizes in spans.items()]


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


# ------------------------------------------------------------------------------------------------ verify
def _model_type_class(cls, model_type, report: Report):
    """(model class, config class): `cls` and its own config class, or where config.json's `model_type` has another
    config class (one architecture name shared by several model types: Glm4MoeForCausalLM for glm4_moe /
    sarvam_moe / param2moe, each with its own defaults), that config class and its causal-LM class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    own = getattr(cls, "config_class", None)
    try:
        config_cls = CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):
        return cls, own
    if own is None or own is config_cls:
        return cls, own
    other = MODEL_FOR_CAUSAL_LM_MAPPING.get(config_cls, cls)
    report.reference = (f"reference: {other.__name__} with {config_cls.__name__} (config.json's model_type "
                        f"{model_type!r}, as transformers' Auto classes read it), not {own.__name__}")
    return other, config_cls


def verify(spec_path, checkpoint, *, device: str = "cpu", dtype: str = "float32", max_tokens: int = 16,
           prompt_lens: Sequence[int] = (3, 9, 17, 30), rtol: float | None = None, seed: int = 0,
           tensor_parallel_size: int = 1) -> Report:
    import numpy as np
    import torch

    ckpt = Path(checkpoint)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise VerifyError(f"{checkpoint}: no config.json")
    hf_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    archs = hf_cfg.get("architectures") or []
    compiled = compile_spec(Path(spec_path))
    ir = compiled.ir
    arch = next((a for a in archs if a in ir.architectures), None)
    if arch is None:
        raise VerifyError(f"{cfg_path}: architectures {archs} are not served by {spec_path} "
                          f"(it serves {', '.join(ir.architectures)})")
    if dtype not in DEFAULT_TOL:
        raise VerifyError(f"--dtype {dtype}: one of {', '.join(DEFAULT_TOL)}")
    tol = DEFAULT_TOL[dtype] if rtol is None else rtol
    report = Report(str(spec_path), str(checkpoint), arch, dtype, tol, tp=tensor_parallel_size)

    with tempfile.TemporaryDirectory(prefix="xllm_gen_verify_") as tmp:
        model_module, runner_module = _import_compiled(compiled.files, ir.name, Path(tmp))
        try:
            config = model_module.Config.from_hf(hf_cfg)
        except ValueError as e:
            report.refused = f"the spec's config guard: {e}"
            return report
        text_cfg = hf_cfg.get("text_config") if isinstance(hf_cfg.get("text_config"), dict) else hf_cfg
        n_layers = int(text_cfg.get("num_hidden_layers", getattr(config, "num_hidden_layers", 0)))

        # the reference: the architecture's class, or the class config.json's model_type names where that reads the
        # config with another config class (transformers' Auto classes and vLLM's config parsing follow model_type)
        import transformers
        torch_dtype = getattr(torch, dtype)
        cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
        cls, config_cls = _model_type_class(cls, hf_cfg.get("model_type"), report)
        if config_cls is not None:
            from .defaults_check import default_mismatches
            report.defaults = default_mismatches(ir.config, model_module.Config, config_cls, hf_cfg, arch, ir.name)
            report.defaults_checked = f"transformers' {config_cls.__name__}"
        # in a 16-bit dtype the reference is transformers in float32 and transformers in that dtype is the yardstick:
        # the engine may be as far from float32 as a few times transformers' own 16-bit error, not farther
        sixteen = torch_dtype != torch.float32
        try:
            extra = {"config": config_cls.from_pretrained(str(ckpt))} if report.reference else {}
            hf, hf16 = (cls.from_pretrained(str(ckpt), dtype=t, attn_implementation="eager", **extra).to(device).eval()
                        if t is not None else None for t in (torch.float32, torch_dtype if sixteen else None))
        except Exception as e:      # the reference side: say so (the spec is not what failed)
            raise VerifyError(f"{checkpoint}: transformers {transformers.__version__} cannot load it with {cls.__name__}"
                              f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), so there is no "
                              f"reference to compare with; the engine was not run") from None
        hf.generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=None,
                                                             bos_token_id=None)     # greedy, EOS ignored
        if sixteen:
            report.notes.append(f"reference: transformers in float32; the bounds are {YARDSTICK}x transformers' own "
                                f"{dtype} error on each layer / log-probability (at least {tol:g} / "
                                f"{LOGPROB_TOL[dtype]:g}); a greedy token may differ only at a near-tie")
        vocab = int(getattr(config, "vocab_size", text_cfg.get("vocab_size")))
        rng = np.random.default_rng(seed)
        allowed = _ordinary_token_ids(ckpt, vocab)
        prompts = [allowed[rng.integers(0, len(allowed), n)].tolist() for n in prompt_lens]
        allowed_set = set(allowed.tolist())

        def hf_greedy(ids):
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[0, len(ids):].tolist()

        if not n_layers:    # a config whose layer count is derived (NemotronH: len(layers_block_type))
            n_layers = int(getattr(hf.config.get_text_config(), "num_hidden_layers", 0) or 0)
        try:
            hf_layers = _decoder_layers(hf, n_layers)
        except VerifyError:     # a looped decoder (HRM-Text): no list of its executed layers, so greedy tokens only
            hf_layers = None
        hf_rec = _Recorder(hf_layers or [], engine=False)
        hf16_rec = _Recorder(_decoder_layers(hf16, n_layers) if sixteen and hf_layers else [], engine=False)

        from xllm_gen import LLM, SamplingParams
        with _served_by(model_module, runner_module, Path(tmp), ir.name, tensor_parallel_size):
            try:
                llm = LLM(model=str(ckpt), device=device, dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
                          tensor_parallel_size=tensor_parallel_size,
                          max_model_len=max(prompt_lens) + max_tokens + 1, max_num_seqs=4)
            except Exception as e:     # the loader's strict checks: a tensor the spec has no parameter for, ...
                hf_rec.remove()
                hf16_rec.remove()
                report.refused = f"the engine cannot load the checkpoint with this spec: {type(e).__name__}: {e}"
                return report
        try:
            runner = llm.engine.runner
            eng_model = (runner.runner if tensor_parallel_size > 1 else runner).model   # rank 0's (the residual
            # stream is whole on every rank: the row-parallel outputs are all-reduced)
            report.notes += _unexercised(eng_model, max(prompt_lens) + max_tokens)
            eng_rec = _Recorder(_decoder_layers(eng_model, n_layers) if hf_layers is not None else [], engine=True)
            greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=LOGPROB_TOP)
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=LOGPROB_TOP,
                                 prompt_logprobs=LOGPROB_TOP)
            for ids in prompts:
                want = _reference(lambda: hf_greedy(ids), cls, checkpoint)
                got_out = llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0]
                got = got_out.token_ids
                cont = want[:-1]                           # teacher-forced: prompt + the reference continuation,
                bad = [i for i, t in enumerate(cont) if t not in allowed_set]   # up to a special token
                seq = ids + cont[: bad[0] if bad else len(cont)]
                hf_rec.arm()
                with torch.no_grad():
                    x = torch.tensor([seq], device=device)
                    hf_logits = _reference(lambda: hf(input_ids=x, attention_mask=torch.ones_like(x),
                                                      use_cache=False).logits[0], cls, checkpoint)
                ref = hf_rec.take()
                lp_tol, layer_tols, near_tie = LOGPROB_TOL[dtype], None, None
                if sixteen:                  # the yardstick: transformers' own 16-bit error on the same sequence
                    hf16_rec.arm()
                    with torch.no_grad():
                        logits16 = _reference(lambda: hf16(input_ids=x, attention_mask=torch.ones_like(x),
                                                           use_cache=False).logits[0], cls, checkpoint)
                    layer_tols = [max(YARDSTICK * _rel_error(a16, a), tol) for a16, a in zip(hf16_rec.take(), ref)]
                    own = _own_logprob_error(hf_logits, logits16)
                    lp_tol = max(YARDSTICK * own, LOGPROB_TOL[dtype])
                    def row_logits(d, ids=ids, want=want, hf_logits=hf_logits):
                        if len(ids) - 1 + d < len(hf_logits):
                            return hf_logits[len(ids) - 1 + d]
                        y = torch.tensor([ids + want[:d]], device=device)   # past a special token the teacher-forced
                        with torch.no_grad():                                 # run stopped: this step's own forward
                            return hf(input_ids=y, attention_mask=torch.ones_like(y), use_cache=False).logits[0, -1]
                    near_tie = _near_tie(row_logits, want, list(got), max(NEAR_TIE, 2 * own))
                eng_rec.arm()
                out = llm.generate([{"prompt_token_ids": seq}], one)[0]
                mine = eng_rec.take()
                lp_err, lp_bad = _logprob_error(hf_logits, out, lp_tol)
                step_err, step_bad = _step_logprob_error(hf_logits, len(ids), want, got_out, lp_tol)
                layers = []
                for l, (a, b) in enumerate(zip(ref, mine)):
                    if a.shape != b.shape:
                        raise VerifyError(f"layer {l}: transformers' hidden states {tuple(a.shape)} vs the engine's "
                                          f"{tuple(b.shape)}")
                    diff = (b.float() - a.float()).abs()
                    scale = a.float().abs().max().clamp_min(1e-12)
                    per_pos = diff.max(dim=-1).values / scale
                    bad = (per_pos > (layer_tols[l] if layer_tols else tol)).nonzero()
                    layers.append(LayerError(l, float(per_pos.max()), float(diff.max()),
                                             int(bad[0, 0]) if len(bad) else None))
                report.prompts.append(PromptResult(len(ids), want, list(got), layers, lp_err, lp_bad,
                                                   step_err, step_bad, near_tie))
            eng_rec.remove()
        finally:
            llm.shutdown()
            hf_rec.remove()
            hf16_rec.remove()
    return report
