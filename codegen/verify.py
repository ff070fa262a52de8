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
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .compiler import compile_spec
from .verify_compare import (  # noqa: F401 - logprob_row_error: the batteries' import
    _first_diff,
    _follows_own_forward,
    _logprob_error,
    _near_tie,
    _own_logprob_error,
    _reference,
    _rel_error,
    _step_logprob_error,
    _unexercised,
    loaded_weights_note,
    logprob_row_error,
    missing_weights_note,
    weak_weights_note,
)
from .verify_exact import USED_NOTE, WIDE_NOTE, exact_bounds, fixed_bounds_note, float64_reference, wide_bounds
from .verify_float64 import Float64, engine_failed
from .verify_hooks import _decoder_layers, _final_norm, _final_norm_name, _Recorder  # noqa: F401 - tests import them
from .verify_report import (  # noqa: F401 - the names verify's callers import from here
    DEFAULT_TOL,
    LOGPROB_TOL,
    LOGPROB_TOP,
    NEAR_TIE,
    YARDSTICK,
    LayerError,
    PromptResult,
    Report,
    VerifyError,
)
from .verify_routing import contaminated, forced_routing, moe_layers, record_routing, routing_ties
from .writer import write


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
def _served_by(model_module, runner_module, tmp: Path | None = None, name: str = "", tp: int = 1):
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
    first = {registry.SEARCH_PATH_ENV: str(tmp), registry.PREFER_ENV: package}
    saved = {k: os.environ.get(k) for k in first}
    for k, v in first.items():          # ahead of what the user set
        os.environ[k] = os.pathsep.join([v] + ([saved[k]] if saved[k] else []))

    def forget():      # the package's modules: an earlier verify's (another temporary directory), or this one's
        for m in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[m]
    forget()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forget()


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
    if own is None:                 # the Auto class (an architecture name transformers does not ship, e.g. a
        return cls, config_cls      # remote-code MPTForCausalLM): it reads config.json by model_type, so do the defaults
    if own is config_cls:
        return cls, own
    other = MODEL_FOR_CAUSAL_LM_MAPPING.get(config_cls, cls)
    report.reference = (f"reference: {other.__name__} with {config_cls.__name__} (config.json's model_type "
                        f"{model_type!r}, as transformers' Auto classes read it), not {own.__name__}")
    return other, config_cls


def verify(spec_path, checkpoint, *, device: str = "cpu", dtype: str = "float32", max_tokens: int = 16,
           prompt_lens: Sequence[int] = (3, 9, 17, 30), rtol: float | None = None, seed: int = 0,
           tensor_parallel_size: int = 1, trust_remote_code: bool = False) -> Report:
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
        # the decoder layers the spec builds (LongCat-Flash: num_layers, where transformers' num_hidden_layers is
        # twice that: its sublayers), else config.json's count
        try:
            n_layers = int(ir.layer.count.eval(vars(config)))
        except (KeyError, TypeError, ValueError, AttributeError):
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
        else:
            report.notes.append(f"defaults: not checked (transformers has no config class for model_type "
                                f"{hf_cfg.get('model_type')!r}): each field absent from config.json is read with the "
                                f"spec's default, which nothing here compares with the modeling code's")
        # in a 16-bit dtype the reference is transformers in float32 and transformers in that dtype is the yardstick:
        # the engine may be as far from float32 as a few times transformers' own 16-bit error, not farther
        sixteen = torch_dtype not in (torch.float32, torch.float64)
        wide = torch_dtype == torch.float64     # both sides in float64 throughout (verify_float64.py, verify_exact.py)
        f64 = Float64()
        if wide and (device != "cpu" or tensor_parallel_size > 1):
            raise VerifyError(f"--dtype float64 runs on the CPU at TP 1 only (--device {device}, --tp {tensor_parallel_size})")
        try:
            # trust_remote_code: a family transformers does not ship is its checkpoint's own modeling code (auto_map)
            remote = {"trust_remote_code": True} if trust_remote_code else {}
            extra = {"config": config_cls.from_pretrained(str(ckpt), **remote)} if report.reference else {}
            hf, info = cls.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager",
                                           output_loading_info=True, **extra, **remote)
            hf = hf.to(device).eval()
            hf16 = (cls.from_pretrained(str(ckpt), dtype=torch_dtype, attn_implementation="eager", **extra, **remote)
                    .to(device).eval() if sixteen else None)
        except Exception as e:      # the reference side: say so (the spec is not what failed)
            raise VerifyError(f"{checkpoint}: transformers {transformers.__version__} cannot load it with {cls.__name__}"
                              f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), so there is no "
                              f"reference to compare with; the engine was not run"
                              + ("" if trust_remote_code or "auto_map" not in hf_cfg else
                                 " (config.json has an auto_map: --trust-remote-code runs the checkpoint's own "
                                 "modeling code as the reference)")) from None
        hf.generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=None,
                                                             bos_token_id=None)     # greedy, EOS ignored
        report.notes += weak_weights_note(hf) + loaded_weights_note(hf, ckpt) + missing_weights_note(hf, info)
        # float32 on the CPU, no --atol: transformers' float64 run measures its own float32 error, the yardstick; in
        # float64 the two swap (the float64 run is the reference, the float32 one measures the stages' conditioning)
        hf64 = (float64_reference(cls, ckpt, hf, {**extra, **remote}, report)
                if not sixteen and (rtol is None or wide) and device == "cpu" else None)
        if wide and hf64 is None:
            raise VerifyError(f"--dtype float64: no float64 reference here ({report.notes[-1]}); use --dtype float32")
        if wide:
            hf64.generation_config, hf, hf64 = hf.generation_config, hf64, hf      # the float64 run the reference
        if sixteen:
            report.notes.append(f"reference: transformers in float32; the bounds are {YARDSTICK}x transformers' own "
                                f"{dtype} error on each layer / log-probability (at least {tol:g} / "
                                f"{LOGPROB_TOL[dtype]:g}); a greedy token may differ only at a near-tie")
        vocab = int(getattr(config, "vocab_size", text_cfg.get("vocab_size")))
        rng = np.random.default_rng(seed)
        allowed = _ordinary_token_ids(ckpt, vocab)
        prompts = [allowed[rng.integers(0, len(allowed), n)].tolist() for n in prompt_lens]
        allowed_set = set(allowed.tolist())

        cached_logits: dict = {}      # prompt -> transformers' cached generate's logits of each step

        def hf_greedy(ids):
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
            if getattr(out, "logits", None):
                cached_logits[tuple(ids)] = torch.cat([l.float() for l in out.logits])
            return out.sequences[0, len(ids):].tolist()

        if not n_layers:    # a config whose layer count is derived (NemotronH: len(layers_block_type))
            n_layers = int(getattr(hf.config.get_text_config(), "num_hidden_layers", 0) or 0)
        try:
            hf_layers = _decoder_layers(hf, n_layers)
        except VerifyError:     # a looped decoder (HRM-Text): no list of its executed layers, so greedy tokens only
            hf_layers = None
            report.notes.append(f"per-layer comparison: not run (transformers' {type(hf).__name__} has no list of the "
                                f"{n_layers} decoder layers the spec builds); the tokens and log-probabilities are "
                                f"compared, a divergence is not located")
        # the final norm, a stage after the last layer, where both sides have it (a wrong final eps moved the
        # log-probabilities by 4e-6, under their bound: a blind exercise's wrong spec passed)
        norm_name = _final_norm_name(ir)
        hf_tail = _final_norm(hf, norm_name)
        report.final_norm = hf_tail is not None and bool(hf_layers)
        hf_rec = _Recorder(hf_layers or [], engine=False, tail=hf_tail)
        hf16_rec = _Recorder(_decoder_layers(hf16, n_layers) if sixteen and hf_layers else [], engine=False,
                             tail=_final_norm(hf16, norm_name) if sixteen and hf_tail is not None else None)
        hf64_rec = _Recorder(_decoder_layers(hf64, n_layers) if hf64 is not None and hf_layers else [], engine=False,
                             tail=_final_norm(hf64, norm_name) if hf64 is not None and hf_tail is not None else None)

        from xllm_gen import LLM, SamplingParams
        with _served_by(model_module, runner_module, Path(tmp), ir.name, tensor_parallel_size):
            max_len = max(prompt_lens) + max_tokens + 1
            try:
                llm = LLM(model=str(ckpt), device=device, dtype=torch_dtype, enforce_eager=True, enable_prefix_caching=False,
                          tensor_parallel_size=tensor_parallel_size, max_model_len=max_len, max_num_seqs=4)
            except Exception as e:     # the loader's strict checks: a tensor the spec has no parameter for, ...
                hf_rec.remove()
                hf16_rec.remove()
                hf64_rec.remove()
                if "max_model_len" in str(e):       # verify's own sequences, not the spec: say so
                    raise VerifyError(f"verify's longest sequence ({max(prompt_lens)} prompt tokens + {max_tokens} new, "
                                      f"and one slot for the step after: max_model_len {max_len}) does not fit this "
                                      f"checkpoint ({e}): pass shorter --prompt-lens or fewer --max-tokens") from None
                report.refused = f"the engine cannot load the checkpoint with this spec: {type(e).__name__}: {e}"
                return report
            runner = llm.engine.runner
            eng_model = (runner.runner if tensor_parallel_size > 1 else runner).model   # rank 0's (the residual
            # stream is whole on every rank: the row-parallel outputs are all-reduced)
            # 16-bit MoE: the engine's own float32 routing tells rounding's near-ties from routing errors
            llm32 = (LLM(model=str(ckpt), device="cpu", dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                         max_model_len=max_len, max_num_seqs=4) if sixteen and moe_layers(eng_model) else None)
        promoted = contextlib.ExitStack()       # float64: every forward below promoted, but the float32 yardstick's
        try:
            report.notes += _unexercised(eng_model, max(prompt_lens) + max_tokens)
            if wide:    # the tables the engine builds on first use (rotary frequencies) built as served, outside
                llm.generate([{"prompt_token_ids": prompts[0][:2]}], SamplingParams(temperature=0.0, max_tokens=1))
                promoted.enter_context(f64.active())
            # the generated decoder's final norm (where the spec has one); without it the stage is not compared
            eng_tail = _final_norm(eng_model, "model.norm") if report.final_norm else None
            report.final_norm = eng_tail is not None
            eng_rec = _Recorder(_decoder_layers(eng_model, n_layers) if hf_layers is not None else [], engine=True,
                                tail=eng_tail)
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
                if hf64 is not None:         # the yardstick: transformers' own float32 error against float64
                    hf64_rec.arm()
                    try:
                        with torch.no_grad(), (f64.paused() if wide else contextlib.nullcontext()):
                            logits64 = hf64(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0]
                        exact = hf64_rec.take()
                    except Exception as e:   # noqa: BLE001 - a float64 forward that fails (a float32-only kernel)
                        hf64_rec.take()
                        fixed_bounds_note(report, "transformers' float64 run failed", e)
                        hf64 = None
                    else:
                        lp_tol, layer_tols = (wide_bounds(hf_logits, logits64, ref, exact, rtol) if wide else
                                              exact_bounds(logits64, hf_logits, exact, ref))
                def forward_row(k, prefix, ids=ids, want=want, hf_logits=hf_logits):
                    """transformers' uncached logits of step k after the prompt and `prefix`: the teacher-forced
                    row where prefix is the reference's own continuation, else (past a special token the
                    teacher-forced run stopped at, or another prefix) this step's own forward."""
                    if list(prefix) == want[:k] and len(ids) - 1 + k < len(hf_logits):
                        return hf_logits[len(ids) - 1 + k]
                    y = torch.tensor([ids + list(prefix)], device=device)
                    with torch.no_grad():
                        return hf(input_ids=y, attention_mask=torch.ones_like(y), use_cache=False).logits[0, -1]
                if sixteen:                  # the yardstick: transformers' own 16-bit error on the same sequence
                    hf16_rec.arm()
                    with torch.no_grad():
                        logits16 = _reference(lambda: hf16(input_ids=x, attention_mask=torch.ones_like(x),
                                                           use_cache=False).logits[0], cls, checkpoint)
                    layer_tols = [max(YARDSTICK * _rel_error(a16, a), tol) for a16, a in zip(hf16_rec.take(), ref)]
                    own = _own_logprob_error(hf_logits, logits16)
                    lp_tol = max(YARDSTICK * own, LOGPROB_TOL[dtype])
                    near_tie = _near_tie(lambda d: forward_row(d, want[:d]), want, list(got), max(NEAR_TIE, 2 * own))
                own_forward = (_follows_own_forward(forward_row, want, list(got))
                               if _first_diff(want, list(got)) is not None else None)
                outs, tie, free_tie, routing_error = [], None, None, None
                run = lambda: outs.append(llm.generate([{"prompt_token_ids": seq}], one)[0])  # noqa: E731
                if llm32 is not None:
                    # the engine's 16-bit routing against its float32 routing: routing errors, and the positions
                    # of the free run (greedy decode) left to compare
                    routed = record_routing(eng_model, lambda: llm.generate([{"prompt_token_ids": seq}], one))
                    routed32 = record_routing(llm32.engine.runner.model,
                                              lambda: llm32.generate([{"prompt_token_ids": seq}], one))
                    ties = routing_ties(routed.views, routed32.views, len(seq))
                    routing_error = (f"experts differ from float32's where {dtype} rounding cannot overturn the "
                                     f"choice (MoE layer, positions, float32 margins, noise): {ties.errors}"
                                     if ties.errors else None)
                    free_tie = ties.tie | contaminated(ties.differs)
                    d = _first_diff(want, got)
                    if (near_tie is None and d is not None and len(ids) - 1 + d < len(free_tie)
                            and free_tie[len(ids) - 1 + d]):
                        near_tie = (d, 0.0, 0.0, "routing")
                eng_rec.arm()
                if llm32 is None:
                    run()
                elif tensor_parallel_size == 1:  # teacher-forced in 16 bits with float32's routing: every position
                    with forced_routing(eng_model, routed32.logits):
                        run()
                else:                            # other ranks route by their own logits: the ties set aside, and
                    run()                        # the positions after a flip (they attend to it)
                    tie = ties.tie | contaminated(ties.differs)
                out = outs[0]
                mine = eng_rec.take()
                lp_err, lp_bad = _logprob_error(hf_logits, out, lp_tol, tie)
                step_err, step_bad = _step_logprob_error(hf_logits, len(ids), want, got_out, lp_tol, free_tie)
                if step_bad is not None and tuple(ids) in cached_logits and free_tie is None:
                    # transformers' cached generate may itself differ from its uncached forward (Doge's top-k of
                    # per-key biases breaks a tie otherwise on the shorter cached row): decode steps that follow the
                    # cached reference within the bound are transformers' own disagreement, as for greedy tokens
                    c_err, c_bad = _step_logprob_error(cached_logits[tuple(ids)], 1, want, got_out, lp_tol)
                    if c_bad is None:
                        report.notes.append(
                            f"prompt {len(report.prompts)}: the decode steps' log-probabilities differ from "
                            f"transformers' uncached forward from step {step_bad} ({step_err:.1e}) but follow its "
                            f"cached generate (max error {c_err:.1e}): transformers' cache disagrees with its own "
                            f"forward there")
                        step_err, step_bad = c_err, None
                layers = []
                for l, (a, b) in enumerate(zip(ref, mine)):
                    if a.shape != b.shape:
                        raise VerifyError(f"layer {l}: transformers' hidden states {tuple(a.shape)} vs the engine's "
                                          f"{tuple(b.shape)}")
                    diff = (b.double() - a.double()).abs()
                    scale = a.double().abs().max().clamp_min(1e-300)
                    per_pos = diff.max(dim=-1).values / scale
                    if tie is not None and per_pos.shape[0] == len(tie):
                        per_pos = per_pos.masked_fill(tie.to(per_pos.device), 0.0)
                    bound = layer_tols[l] if layer_tols else tol
                    bad = (per_pos > bound).nonzero()
                    layers.append(LayerError(l, float(per_pos.max()), float(diff.max()),
                                             int(bad[0, 0]) if len(bad) else None, bound))
                if free_tie is not None and 2 * int(free_tie.sum()) > len(seq):
                    report.notes.append(f"prompt {len(report.prompts)}: {int(free_tie.sum())} of {len(seq)} positions "
                                        f"of the free run route within {dtype} rounding of a tie or after other "
                                        f"experts (set aside from the greedy steps; "
                                        + ("the teacher-forced comparison routes as float32 and covers all)"
                                           if tensor_parallel_size == 1 else
                                           f"at TP {tensor_parallel_size} every rank routes by its own logits, so "
                                           f"they are set aside from the teacher-forced comparison too)"))
                report.prompts.append(PromptResult(len(ids), want, list(got), layers, lp_err, lp_bad,
                                                   step_err, step_bad, near_tie,
                                                   int(free_tie.sum()) if free_tie is not None else 0,
                                                   routing_error, lp_tol, own_forward))
            eng_rec.remove()
        except Exception as e:      # a float32 state buffer the float64 run writes into (Mamba's): said, not the spec
            if wide and not isinstance(e, VerifyError):
                raise engine_failed(e) from None
            raise
        finally:
            promoted.close()
            report.notes += f64.residue_note()
            llm.shutdown()
            if llm32 is not None:
                llm32.shutdown()
            hf_rec.remove()
            hf16_rec.remove()
            hf64_rec.remove()
    if hf64 is not None:
        report.notes.append(WIDE_NOTE if wide else USED_NOTE)
    return report
