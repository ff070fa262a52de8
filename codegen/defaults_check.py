"""The spec's reading of absent and null config.json fields against transformers' config class (issue 20): what an
absent field means is the class's default for that family, never "anything goes", and an explicit null is what the
class makes of None (`if_null`). Used by `xllm-gen verify` on the checkpoint's own config.json and by
tests/test_absent_defaults.py on every served family's class defaults.

For each symbol the spec reads from a top-level field: (1) the field absent (its fallbacks, other fields, as given);
(2) absent, and each fallback field present with another valid value (a fallback transformers does not read, Gemma
2's hidden_act beside hidden_activation, must not change the value); (3) absent, and the heads or the hidden size
doubled (a constant default and one computed from them coincide at the class defaults); (4) the field null, with the
sizes as given and doubled. The spec's value must equal the class's, or the config be refused (never served wrong);
a null that transformers gives a value, where the spec serves the field absent, must not be refused. A symbol read
from a nested path first (`[rope_parameters.rope_theta, rope_theta]`) is checked with the mapping and its other
paths absent (arms 1 and 3), the class's value read where it keeps it; a field the class pops from its kwargs is read
from its `_<name>` attribute (Gemma 3's sliding_window_pattern).
"""
from __future__ import annotations

import json

from xllm_gen.runtime.loading.hf_config import _is_num
from xllm_gen.runtime.rope_kinds import LEGACY_ROPE_MAPPING, ROPE_MAPPING

from .resolver_config import HF_ROPE_TYPES  # transformers' rope type -> the rotary kind the config reader gives

# identity and generation-stop fields (the engine also reads generation_config.json), not the math
NOT_MATH = {"eos_token_id", "bos_token_id", "pad_token_id", "model_type"}

# (3): a default computed from these (head_dim = hidden / heads) or constant (Qwen3Config's 128) only shows when
# they move away from the class defaults, where the two coincide
SIZES = ("num_attention_heads", "hidden_size")


def _norm(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _other(value, typ: str, values: tuple):
    """Another valid value of a field of type `typ` (None: none to offer)."""
    if typ == "str":
        return next((v for v in values if v != value), None)
    if isinstance(value, bool) or typ == "bool":
        return None if value is None else not value
    if typ == "int" and isinstance(value, int):
        return value * 2 if value else 1
    if typ == "float" and isinstance(value, (int, float)):
        return value * 2 if value else 0.5
    return None


_MISSING = object()


def _lookup(obj, path: str):
    """A dotted path on a transformers config (attributes, then mapping keys: rope_parameters.rope_theta), or on a
    config.json dict; a field the class pops from its kwargs lives under `_<name>` (Gemma 3's
    `_sliding_window_pattern`). _MISSING where it does not resolve."""
    for i, part in enumerate(path.split(".")):
        if isinstance(obj, dict):
            obj = obj.get(part, _MISSING)
        else:
            try:                # a per-layer attribute of a heterogeneous config raises: no single value
                v = getattr(obj, part, _MISSING)
                obj = getattr(obj, f"_{part}", _MISSING) if v is _MISSING and i == 0 else v
            except Exception:  # noqa: BLE001
                return _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


def _without(hf: dict, paths) -> dict:
    """config.json without the given (dotted) paths: a nested key is removed from a copy of its mapping."""
    out = json.loads(json.dumps(hf))
    for path in paths:
        *parents, last = path.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def _mismatch(cls, config, hf: dict, field, name: str, what: str, null: bool = False,
              typ: str = "", served_absent: bool = True) -> str | None:
    """transformers' value of `field` (a path, or a list of them: the first that the class's config resolves) on
    this config.json vs the spec's symbol `name` (None: the same, or no reference / a refusal). `null`: config.json
    writes the field as null (`served_absent`: the spec has a default, so refusing the null where transformers gives
    it a value refuses a checkpoint transformers serves)."""
    fields = [field] if isinstance(field, str) else list(field)
    try:        # (a private `_<name>` copy in config.json, which save_pretrained writes, is no reading of the field)
        ref = cls.from_dict(_without(hf, [f"_{f}" for f in fields if "." not in f]))
    except Exception:                        # transformers cannot build it: nothing to compare
        return None
    want = next((v for v in (_lookup(ref, f) for f in fields) if v is not _MISSING), _MISSING)
    if want is _MISSING:                     # the class keeps no such field: nothing to compare
        return None
    field = fields[0]
    try:
        got = getattr(config.from_hf(json.loads(json.dumps(hf))), name)
    except ValueError as e:                  # refused by the guard: never served wrong
        if null and want is not None and served_absent and f"field '{field}' is null" in str(e):
            # but a null that transformers gives a value must be read as that value (`if_null`), not refused
            return f"{what}: transformers' {cls.__name__} means {field} = {want!r}, the spec refuses the null"
        return None
    if isinstance(got, tuple) and want is not None and not isinstance(want, (list, tuple, dict)):
        want = (want,)      # an `int | list[int]` field (HunYuan's num_experts): a tuple symbol reads a scalar as (x,)
    if null and want is None and (got is False or typ != "bool"):
        # transformers keeps the null: its modeling code tests a flag by truth (false), and has no value for a number
        # (it fails, or computes one in the modeling code, which this check cannot see): nothing to compare
        return None
    if _norm(got) == _norm(want) or (_is_num(want) and _is_num(got) and float(got) == float(want)):
        return None
    return f"{what}: transformers' {cls.__name__} means {field} = {want!r}, the spec reads {name} = {got!r}"


def _rope_mismatch(cls, config, base: dict, paths: list, name: str, arch: str) -> str | None:
    """A rope symbol with its mapping absent from config.json: the rope type (and the scaling keys both hold) that
    transformers' class fills in, against the spec's reading. CwmConfig fills in llama3 (factor 16, ...); a spec that
    read the absent mapping as the plain rope served another model (a blind exercise found it by hand)."""
    roots = [p.split(".")[0] for p in paths]
    roots += [LEGACY_ROPE_MAPPING] if ROPE_MAPPING in roots else []
    hf = {**_without(base, roots), "architectures": [arch]}
    want = _held(cls, hf, [ROPE_MAPPING, LEGACY_ROPE_MAPPING])
    if want is not None and not isinstance(want, dict):
        return None         # a per-layer-type mapping of mappings, or another form: not judged here
    try:
        got = getattr(config.from_hf(json.loads(json.dumps(hf))), name)
    except ValueError:      # refused by the guard: never served wrong
        return None
    want, got = dict(want or {}), dict(got or {})
    kind_w = want.get("rope_type", want.get("type")) or "default"
    kind_w = HF_ROPE_TYPES.get(kind_w, kind_w)
    kind_g = got.get("rope_type", got.get("type")) or "default"
    what = f"{' / '.join(paths)} absent"
    if kind_w != kind_g:
        return f"{what}: transformers' {cls.__name__} means rope type {kind_w!r} ({want}), the spec reads {name} = " \
               f"{kind_g!r}"
    differ = sorted(k for k, v in want.items() if k in got and k not in ("rope_type", "type", "rope_theta")
                    and _is_num(v) and _is_num(got[k]) and float(v) != float(got[k]))
    if differ:
        return f"{what}: transformers' {cls.__name__} means {', '.join(f'{k} = {want[k]!r}' for k in differ)}, the " \
               f"spec reads {', '.join(f'{k} = {got[k]!r}' for k in differ)} ({name})"
    return None


def _held(cls, hf: dict, ref):
    """What the config class holds at `ref` (a path or paths) for the config.json dict hf; None where it cannot
    build it."""
    try:
        held = cls.from_dict(dict(hf))
    except Exception:       # noqa: BLE001 - transformers cannot build it: nothing to compare
        return None
    for p in [ref] if isinstance(ref, str) else ref:
        v = _lookup(held, p)
        if v is not _MISSING:
            return v
    return None


def _overwritten(cls, base: dict, field: str, arch: str) -> bool:
    """Whether the config class replaces the number config.json gives for `field` by another one, computed from
    other fields (Zamba2Config raises max_position_embeddings to 16384 under use_long_context): then what an absent
    field means is that computation, which the spec reproduces in its own expressions, not a default of the field."""
    given = base.get(field)
    if not _is_num(given) or not given:
        return False
    probe = given * 2                        # another value than a saved config's (which may hold the computed one)
    held = _held(cls, {**base, field: probe, "architectures": [arch]}, field)    # None: transformers cannot build it
    return _is_num(held) and float(held) != float(probe)


def default_mismatches(ir_config, config, config_cls, base: dict, arch: str, spec_name: str = "") -> list[str]:
    """The disagreements (text) of the generated `config` (its Config class) with transformers' `config_cls`, for the
    symbols `ir_config` (the compiled IR's) reads, around the config.json dict `base`. transformers' own warnings about
    the probed configs (each a field removed or changed: a YaRN factor it infers from a probed context, ...) are
    silenced: they would read as warnings about the checkpoint."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _default_mismatches(ir_config, config, config_cls, base, arch, spec_name)
    finally:
        hf_logging.set_verbosity(level)


def _default_mismatches(ir_config, config, config_cls, base: dict, arch: str, spec_name: str = "") -> list[str]:
    cls = config_cls
    wrong = []
    # the bool fields the spec reads that config.json sets: each probed flipped too
    flags = [f.paths[0] for f in ir_config if f.type == "bool" and f.paths and f.expr is None and "." not in f.paths[0]
             and isinstance(base.get(f.paths[0]), bool)]
    for f in ir_config:      # the symbols read from config.json
        if f.expr is not None or f.present or not f.paths or f.guard:    # a guard-only symbol reaches no block
            continue
        # absent is None, whose meaning is in the expressions that read it: not judged, except where a flag the
        # checkpoint sets, flipped, makes the class hold a value there (Qwen3Config's sliding_window: 4096 under
        # use_sliding_window; a spec reading absent as None served full attention)
        none_absent = f.optional and f.default is None and f.default_expr is None
        name, typ, paths, values = f.name, f.type, list(f.paths), tuple(f.values or ())
        field = paths[0]
        if typ == "rope" and not f.same_meaning:
            wrong.append(_rope_mismatch(cls, config, base, paths, name, arch))
            continue
        if typ == "rope" or field in NOT_MATH or f.same_meaning:     # the spec says why it reads it otherwise
            continue
        nested = "." in field
        if nested:
            # a nested path (rope_parameters.rope_theta, then the legacy top-level field): the mapping that holds it
            # absent with every other path, as a Hub config without the field is (a mapping present without its
            # theta reads another default in some classes: Dots3-Note, LFM3, Ministral 3 fill in their global theta;
            # no released config writes one); the class's value read where it keeps it (its rope mapping)
            if all(_lookup(base, p) is _MISSING for p in paths):
                continue
            roots = [p.split(".")[0] for p in paths]
            # a legacy rope_scaling stands for rope_parameters in transformers' configs (and the engine's reader):
            # without the one, also without the other
            roots += [LEGACY_ROPE_MAPPING] if ROPE_MAPPING in roots else []
            hf, ref, absent = _without(base, roots), paths, " / ".join(paths) + " absent"
        elif field in base:
            if _overwritten(cls, base, field, arch):
                continue        # the class computes the field from others whatever config.json says: no default
            hf, ref, absent = {k: v for k, v in base.items() if k != field}, field, f"{field} absent"
        else:
            continue
        hf["architectures"] = [arch]
        if none_absent:
            for flag in flags:
                if flag not in paths:
                    probe = {**hf, flag: not base[flag]}
                    if _held(cls, probe, ref) is not None:
                        wrong.append(_mismatch(cls, config, probe, ref, name, f"{absent}, {flag} = {not base[flag]}"))
            continue
        wrong.append(_mismatch(cls, config, hf, ref, name, absent))
        for alias in [] if nested else paths[1:]:
            if "." in alias or alias in NOT_MATH:
                continue
            other = _other(base.get(alias, base[field]), typ, values)
            if other is not None:
                wrong.append(_mismatch(cls, config, {**hf, alias: other}, field, name,
                                       f"{field} absent, {alias} = {other!r}"))
        for size in SIZES:      # (3) a size another default may be computed from, doubled: constant or computed?
            if size not in paths and isinstance(base.get(size), int):
                wrong.append(_mismatch(cls, config, {**hf, size: base[size] * 2}, ref, name,
                                       f"{absent}, {size} = {base[size] * 2}"))
        for flag in flags:      # (3b) a flag the default may hang on, flipped (Qwen3Config: an absent sliding_window
            if flag not in paths:   # is 4096 under use_sliding_window, None otherwise; a checkpoint has one of them)
                wrong.append(_mismatch(cls, config, {**hf, flag: not base[flag]}, ref, name,
                                       f"{absent}, {flag} = {not base[flag]}"))
        if nested:
            continue
        # (4) the field written as null: what the class makes of None (Qwen3Config: num_key_value_heads absent is 32,
        # null is num_attention_heads), with the sizes as given and doubled
        for size in (None,) + SIZES:
            if size is None or (size != field and isinstance(base.get(size), int)):
                nulled = {**hf, field: None, **({size: base[size] * 2} if size else {})}
                wrong.append(_mismatch(cls, config, nulled, field, name, f"{field} null" + (
                    f", {size} = {base[size] * 2}" if size else ""), null=True, typ=typ,
                                       served_absent=f.has_default))
    return [w for w in wrong if w]
