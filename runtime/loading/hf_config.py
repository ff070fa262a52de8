"""Reading a checkpoint's config.json through a spec's declared mapping (rendered into Config.from_hf).

Types are strict (no bool("false"), no int(2.7)), values are checked against what the spec models, and the
config guard refuses a checkpoint with a field that changes the math but that the spec neither reads nor
assumes: a checkpoint that loads is served right, or not at all. Every error names the spec and the field.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, Iterable, Mapping, Optional

from xllm_gen.runtime.loading.config_paths import (  # noqa: F401  (re-exported: ConfigError, MISSING)
    EACH,
    MISSING,
    ConfigError,
    WildcardConflict,
    _flatten,
    _is_int,
    _is_num,
    _lookup,
    _present_null,
    each_path,
    each_split,
)
from xllm_gen.runtime.rope_kinds import (
    LEGACY_ROPE_MAPPING,
    ROPE_LIST_KEYS,
    ROPE_MAPPING,
    ROPE_SCALING_KEYS,
    ROPE_SHARED_KEYS,
)

_MAX_INT = 2 ** 63          # ints a config field or a spec expression may hold (codegen/expr.py MAX_INT)


GENERIC_FIELDS = frozenset("""
    _name_or_path _commit_hash _attn_implementation _attn_implementation_autoset _attn_implementation_internal
    transformers_version model_type architectures dtype torch_dtype use_bfloat16 return_dict output_hidden_states
    output_attentions torchscript tf_legacy_loss pruned_heads tie_encoder_decoder is_encoder_decoder is_decoder
    cross_attention_hidden_size add_cross_attention chunk_size_feed_forward finetuning_task id2label label2id
    num_labels task_specific_params problem_type tokenizer_class prefix bos_token_id pad_token_id eos_token_id
    sep_token_id decoder_start_token_id use_cache initializer_range max_length min_length do_sample early_stopping
    num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p repetition_penalty
    length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids num_return_sequences
    output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens attention_dropout
    unk_token_id _model_name_or_path
    unk_token_id cls_token_id mask_token_id output_past use_return_dict _from_model_config output_router_logits
    gradient_checkpointing
    auto_map cache_implementation transformers.js_config
""".split())
# auto_map: the remote-code classes of a Hub repository; transformers runs its own class for `model_type` unless asked
# to trust remote code, and the specs are judged against that class. cache_implementation: a generation setting (the
# KV-cache kind of `generate`). transformers.js_config: the settings of transformers.js (a key with a dot: matched as
# a whole top-level key).

# Config symbols the runtime reads by name (engine: eos ids, context length, vocab size; prefill graphs: the
# hidden size): a spec that reads them uses them, even where its generated model does not (codegen/usage.py).
RUNTIME_READS = frozenset({"eos_token_id", "max_position_embeddings", "vocab_size", "hidden_size"})

# A rope-parameters mapping's keys per scaling kind: runtime/rope_kinds.py (the rotary primitive reads the
# same table). Read like transformers: original_max_position_embeddings falls back to max_position_embeddings
# where a kind needs it. rope_theta and the mRoPE keys are read by other symbols of the spec.
_ROPE_NEEDS_ORIGINAL = ("frequency_bands", "longrope")
# YaRN keys transformers tests by their truth (its attention factor takes the mscale ratio only when both are set,
# the attention's softmax mscale only when mscale_all_dim is): a 0 is the same as the key left out
_ROPE_ZERO_IS_ABSENT = {"yarn": ("mscale", "mscale_all_dim")}


def _rope_scaling_wins(node: dict) -> dict:
    """config.json with both a (legacy) `rope_scaling` mapping and `rope_parameters`, at the top level or in
    `text_config`: transformers' configs take rope_scaling for rope_parameters (PreTrainedConfig.
    convert_rope_params_to_dict: `rope_scaling or rope_parameters`; a missing theta then comes from the top-level
    rope_theta), so a spec reading rope_parameters first reads what transformers computes with; a mapping per layer
    type takes rope_scaling into its full_attention entry. A copy; others as is."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _rope_scaling_wins(out["text_config"])
    scaling = out.get(LEGACY_ROPE_MAPPING)
    params = out.get(ROPE_MAPPING)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        # a mapping per layer type: transformers' configs that keep one merge a legacy rope_scaling into its
        # full_attention entry (its theta kept); one without that entry has no reading
        if isinstance(scaling, dict) and scaling:
            if not isinstance(params.get("full_attention"), dict):
                raise ConfigError(f"config.json: `{LEGACY_ROPE_MAPPING}` beside a `{ROPE_MAPPING}` per layer type "
                                  f"without a full_attention entry: no layers it applies to")
            out[ROPE_MAPPING] = {**params, "full_attention": {**params["full_attention"], **scaling}}
        return out
    if isinstance(scaling, dict) and scaling and ROPE_MAPPING in out and out[ROPE_MAPPING] != scaling:
        params = dict(scaling)
        if "rope_theta" in out and "rope_theta" not in params:
            params["rope_theta"] = out["rope_theta"]
        out[ROPE_MAPPING] = params
    return out


class ConfigReader:
    """Reads the symbols of one spec from a config.json dict, then (`finish`) applies the config guard."""

    def __init__(self, hf: Any, spec: str, *, assume: Optional[Mapping[str, Any]] = None,
                 ignore: Iterable[str] = (), defaults: Optional[Mapping[str, Any]] = None):
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json: the top level must be an object, got {type(hf).__name__}")
        self.hf = _rope_scaling_wins(hf)
        self.spec = spec
        self.assume = dict(assume or {})
        self.ignore = tuple(ignore)
        self.defaults = dict(defaults or {})      # transformers' default of an assumed field, where it is absent
        self.read_paths: set[str] = set()
        self.values: dict[str, Any] = {}
        self.rope_pending: list = []      # rope-mapping keys another symbol may read (checked in finish)

    def error(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.spec}: {msg}")

    def present(self, name: str, path: str) -> bool:
        """Whether config.json has `path` at all (any value, null and `{}` included); its content is not read (the
        guard still wants each key under it read, assumed or ignored)."""
        self.values[name] = _lookup(self.hf, path) is not MISSING or _present_null(self.hf, path)
        return self.values[name]

    def read(self, name: str, type_: str, paths: tuple[str, ...], *, default: Any = MISSING,
             default_fn: Optional[Callable[[], Any]] = None, values: Optional[tuple] = None,
             optional: bool = False, bounds: tuple = (None, None), positive: bool = False,
             truthy: bool = False, if_null: Optional[Callable[[], Any]] = None,
             read_if: Optional[Callable[[], Any]] = None, item_default: Any = MISSING) -> Any:
        self.read_paths.update(paths)
        where = None
        # `read_if` false: the field is not read (whatever it holds), the symbol is its default (None where optional)
        unread = read_if is not None and not self._formula(name, "read_if", read_if)
        for p in () if unread else paths:
            try:
                v = self._each(name, type_, p, optional, item_default) if EACH in p else _lookup(self.hf, p)
            except WildcardConflict as e:
                raise self.error(f"{e} (symbol '{name}' reads one value)") from None
            if v is not MISSING:
                where, value = p, v
                break
        null_at = None if where is not None or unread else next((p for p in paths if _present_null(self.hf, p)),
                                                                None)
        if null_at is not None and not optional and type_ in ("int", "float", "str", "bool"):
            # an explicit null is what transformers' config class makes of None, not its class default (the value of
            # an absent field): what the spec states (`if_null`), false for a flag the modeling code tests by truth;
            # a number or name has no meaning the spec knows (transformers fails on it); a list (token ids, per-layer
            # lists) reads a null as its default
            if if_null is not None:
                where, value = f"{null_at} (null)", self._formula(name, "if_null", if_null)
            elif default_fn is not None:       # the default computed from other symbols, as the class computes it
                pass
            elif type_ == "bool":
                where, value = f"{null_at} (null)", False
            else:
                raise self.error(f"config.json field '{null_at}' is null, and the spec says nothing of what a null "
                                 f"'{name}' means (its absence means the default; a spec states a null's meaning "
                                 f"with `if_null`)")
        if where is None and optional and null_at is not None:
            where, value = null_at, None   # an explicit null: None
        if where is None:
            if default_fn is not None:
                value = self._formula(name, "default_expr", default_fn)
            elif default is not MISSING:
                value = default
            elif optional or type_ == "rope":     # no rope parameters: the default rope
                value = None
            else:
                raise self.error(f"config.json has no field {' or '.join(repr(p) for p in paths)} (symbol '{name}')")
            where = f"{paths[0]} (default)"
        if truthy and type_ == "bool" and _is_int(value):    # an int where the config class tests the field by truth
            value = bool(value)
        value = self.check(name, type_, where, value, values, optional, bounds)
        if positive and value is not None and not value > 0:
            raise self.error(f"config.json field '{where}' = {value!r} must be > 0")
        self.values[name] = value
        return value

    def _each(self, name: str, type_: str, path: str, optional: bool, item_default: Any) -> Any:
        """A `list[*].field` path: the field of every element of a list of mappings, one tuple entry each (MISSING
        where the list is absent or null). An element's absent or null field is `item_default` where the spec gives
        one, false in a bool_tuple where it is null (the modeling code tests a flag by truth), None where the symbol is
        `optional`; otherwise refused naming the element (`block_configs[3].attention.n_heads_in_group`)."""
        head, rest = each_split(path)
        items = _lookup(self.hf, head)
        if items is MISSING:
            return MISSING
        if not isinstance(items, list):
            raise self.error(f"config.json field '{head}' = {_short_repr(items)} is not a list (symbol '{name}' reads "
                             f"'{path}': a field of each element)")
        ok = _ITEM_OK[type_]
        out = []
        for i, element in enumerate(items):
            at = f"{head}[{i}].{rest}"
            if not isinstance(element, dict):
                raise self.error(f"config.json field '{head}[{i}]' = {_short_repr(element)} is not a mapping (symbol "
                                 f"'{name}' reads '{path}')")
            v = _lookup(element, rest)
            if v is MISSING:
                null = _present_null(element, rest)
                if item_default is not MISSING:
                    v = item_default
                elif null and type_ == "bool_tuple":
                    v = False
                elif not optional:
                    raise self.error(f"config.json field '{at}' is {'null' if null else 'missing'} (symbol '{name}' "
                                     f"reads it in every element of '{head}'; the spec gives no `item_default`)")
                else:
                    v = None
            elif not ok(v):
                raise self.error(f"config.json field '{at}' = {v!r} is not {_ARTICLE[type_[:-len('_tuple')]]} "
                                 f"(symbol '{name}' reads '{path}')")
            out.append(v)
        return tuple(out)

    def _assume_each(self, key: str, expected: Any) -> None:
        """`config_assume: {list[*].field: value}`: every element of the list that has the field (non-null) holds the
        value (or one of `any_of`); the first that does not is refused by its index."""
        head, rest = each_split(key)
        items = _lookup(self.hf, head)
        if not isinstance(items, list):
            return
        alike = expected["any_of"] if isinstance(expected, dict) and set(expected) == {"any_of"} else [expected]
        for i, element in enumerate(items):
            got = _lookup(element, rest) if isinstance(element, dict) else MISSING
            if got is not MISSING and not any(_same(got, v) for v in alike):
                shown = " or ".join(repr(v) for v in alike)
                raise self.error(f"assumes config.json {key}={shown}, but this checkpoint has {head}[{i}].{rest}="
                                 f"{got!r}: the spec does not model it")

    def _formula(self, name: str, key: str, fn: Callable[[], Any]) -> Any:
        """A symbol's `default_expr` / `if_null` evaluated on this checkpoint (a formula that fails on it is a
        config error naming the symbol, not a bare IndexError)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a formula that fails on this checkpoint is a config error
            raise self.error(f"symbol '{name}': its {key} cannot be computed from config.json: "
                             f"{type(exc).__name__}: {exc}") from None

    def derive(self, name: str, type_: str, fn: Callable[[], Any], *, optional: bool = False,
               values: Optional[tuple] = None, bounds: tuple = (None, None), source: str = "") -> Any:
        """A derived symbol: its expression over the symbols read so far, type-checked and held to the spec's
        `values` / `min` / `max` like a read field (a checkpoint outside them is refused naming the symbol)."""
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - a formula that fails on this checkpoint is a config error
            raise self.error(f"symbol '{name}' cannot be computed from config.json: {type(exc).__name__}: {exc}") \
                from None
        self.values[name] = self.check(name, type_, f"{name} = {source} (derived)" if source else f"{name} (derived)",
                                       value, values, optional, bounds)
        return self.values[name]

    def check(self, name, type_, where, value, values, optional, bounds) -> Any:
        if value is None:
            if optional or type_ == "rope":
                return {"rope_type": "default"} if type_ == "rope" else None
            raise self.error(f"config.json field '{where}' is null (symbol '{name}' needs a {type_})")
        bad = self.error(f"config.json field '{where}' = {value!r} is not {_ARTICLE.get(type_, 'a ' + type_)}")
        if type_ == "int":
            if not _is_int(value):
                raise bad
        elif type_ == "float":
            if not _is_num(value) or not math.isfinite(value):
                raise bad
            value = float(value)
        elif type_ == "bool":
            if not isinstance(value, bool):
                raise bad
        elif type_ == "str":
            if not isinstance(value, str):
                raise bad
        elif type_.endswith("_tuple"):
            if type_ == "str_tuple" and isinstance(value, str):     # one string is not a list of one string
                raise bad
            items = value if isinstance(value, (list, tuple)) else [value]
            ok = _ITEM_OK[type_]
            # a per-element read (`list[*].field`, `optional`) holds None where an element's field is null or absent
            each = optional and EACH in where
            if not all(ok(x) or (each and x is None) for x in items):
                raise bad
            value = tuple(items)
        elif type_ == "rope":
            value = self.rope(where, value, values)
            values = None
        if values is not None and type_ == "str_tuple":       # each entry one of them (per-layer kinds)
            bad_at = next((i for i, x in enumerate(value) if x not in values and x is not None), None)
            if bad_at is not None:
                field = where.split(" ")[0]
                field = field.replace(EACH, f"[{bad_at}]", 1) if EACH in field else f"{field}[{bad_at}]"
                raise self.error(f"does not model {field}={value[bad_at]!r} (it models: {', '.join(values)})")
        elif values is not None and value not in values:
            shown = where[:-len(" (derived)")] + " =" if where.endswith("(derived)") else where.split(" ")[0] + "="
            raise self.error(f"does not model {shown}{value!r} (it models: {', '.join(values)})")
        if type_ == "int" and not -_MAX_INT < value < _MAX_INT or \
                type_ == "int_tuple" and any(x is not None and not -_MAX_INT < x < _MAX_INT for x in value):
            raise self.error(f"config.json field '{where}' is out of range (ints lie within +-2**63)")
        lo, hi = bounds
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
            what = f"derived symbol '{where[:-len(' (derived)')]}'" if where.endswith("(derived)") \
                else f"config.json field '{where}'"
            raise self.error(f"{what} = {value!r} must be {rng}")
        return value

    def rope(self, where: str, value: Any, types: Optional[dict]) -> dict:
        """A rope-parameters mapping, normalized to {'rope_type': <scaling kind>, <its keys>}; checked per kind.
        `types` maps the checkpoint's rope_type names the spec models to the rotary's scaling kinds."""
        path = where.split(" ")[0]
        if not isinstance(value, dict):
            raise self.error(f"config.json field '{path}' = {value!r} is not a rope-parameters object")
        name = value.get("rope_type", value.get("type", "default"))
        types = types if types is not None else {k: k for k in ROPE_SCALING_KEYS}
        if name not in types:
            raise self.error(f"does not model {path}.rope_type={name!r} (it models: {', '.join(types)})")
        rtype = types[name]
        required, optional = ROPE_SCALING_KEYS[rtype]
        known = required + optional
        out: dict = {"rope_type": rtype}
        for key, v in value.items():
            if key in ROPE_SHARED_KEYS:
                continue
            if key == "partial_rotary_factor" and not isinstance(v, bool) and v in (None, 1, 1.0):
                continue                       # the whole head rotates: what every rotary kind computes
            if key not in known:
                if v is None:
                    continue
                # another key (partial_rotary_factor, Hunyuan's alpha): modeled only where a symbol of the spec
                # reads it (checked in finish)
                self.rope_pending.append((f"{path}.{key}", v, name, known))
                continue
            if key in _ROPE_ZERO_IS_ABSENT.get(rtype, ()) and _is_num(v) and v == 0:
                continue
            if key == "truncate":
                if not isinstance(v, bool):
                    raise self.error(f"config.json field '{path}.{key}' = {v!r} is not a bool")
            elif key in ROPE_LIST_KEYS:        # longrope's per-frequency factors (their length: at model build)
                if not isinstance(v, list) or not v or not all(
                        _is_num(x) and math.isfinite(x) and x > 0 for x in v):
                    raise self.error(f"config.json field '{path}.{key}' must be a non-empty list of positive "
                                     f"numbers, got {v!r}")
            elif v is not None and (not _is_num(v) or not math.isfinite(v) or v <= 0):
                raise self.error(f"config.json field '{path}.{key}' = {v!r} must be a positive number")
            if v is not None:
                out[key] = v
        for key in required + (("original_max_position_embeddings",) if rtype in _ROPE_NEEDS_ORIGINAL else ()):
            if key not in out:
                if key == "original_max_position_embeddings":
                    mpe = _lookup(self.hf, "max_position_embeddings")
                    if _is_int(mpe):   # transformers falls back to max_position_embeddings
                        out[key] = mpe
                        continue
                raise self.error(f"config.json field '{path}' (rope type {name!r}) has no '{key}'")
        return out

    def finish(self) -> dict:
        """The config guard: every field is read, assumed (with the value the spec assumes), ignored, or generic.
        A `quantization_config` is the runtime's, not the spec's: accepted when its method and settings are
        supported (runtime/loading/quant_config.py), refused naming them otherwise."""
        if _lookup(self.hf, "quantization_config") is not MISSING:
            from xllm_gen.runtime.loading.quant_config import QuantConfigError, parse_quant_config
            try:
                parse_quant_config(self.hf)
            except QuantConfigError as e:
                raise self.error(str(e)) from None
            self.read_paths.add("quantization_config")
        for key, v, name, known in self.rope_pending:
            # read by a symbol, or declared with no effect on the math (config_ignore: e.g. a copy of
            # max_position_embeddings inside the rope parameters that the rope type does not read)
            if key not in self.read_paths and not any(fnmatch.fnmatchcase(key, pat) for pat in self.ignore):
                raise self.error(f"does not model {key}={v!r} (rope type {name!r} reads: "
                                 f"{', '.join(known) or 'nothing'}; no symbol of the spec reads it)")
        for key, expected in self.assume.items():
            if EACH in key:             # each element's field: absent or null is the config class's default
                self._assume_each(key, expected)
                continue
            got = _lookup(self.hf, key)
            if isinstance(expected, dict) and set(expected) == {"any_of"}:   # values transformers treats alike
                shown = " or ".join(repr(v) for v in expected["any_of"])
                if got is not MISSING and not any(_same(got, v) for v in expected["any_of"]):
                    raise self.error(f"assumes config.json {key}={shown}, but this checkpoint has {key}={got!r}: "
                                     f"the spec does not model it")
                if got is MISSING and key in self.defaults and \
                        not any(_same(self.defaults[key], v) for v in expected["any_of"]):
                    raise self.error(f"assumes config.json {key}={shown}, but this checkpoint omits {key}, which "
                                     f"means {self.defaults[key]!r} (transformers' default for this family): the "
                                     f"spec does not model it")
                continue
            if got is MISSING and key in self.defaults:      # absent: the family's transformers default applies
                if not _same(self.defaults[key], expected):
                    raise self.error(f"assumes config.json {key}={expected!r}, but this checkpoint omits {key}, "
                                     f"which means {self.defaults[key]!r} (transformers' default for this family): "
                                     f"the spec does not model it")
            elif got is not MISSING and not _same(got, expected):
                raise self.error(f"assumes config.json {key}={expected!r}, but this checkpoint has {key}={got!r}: "
                                 f"the spec does not model it")
        unknown = []
        lists = frozenset(each_split(p)[0] for p in (*self.read_paths, *self.assume) if EACH in p)
        for path, value in ((p, v) for key, sub in self.hf.items() if key not in GENERIC_FIELDS
                            for p, v in _flatten(sub, key, lists)):
            if value is None or value == [] or value == {}:
                continue
            shown_path, path = path, each_path(path)     # block_configs[3].attention.no_op: read as [*]
            parts = path.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            if any(p in self.read_paths or p in self.assume or parts[i] in GENERIC_FIELDS
                   for i, p in enumerate(prefixes)):
                continue
            if any("*" in r and fnmatch.fnmatchcase(p, r) for r in self.read_paths for p in prefixes):
                continue        # read through a `*` path (every key of a mapping)
            if any(fnmatch.fnmatchcase(p, pat.replace(EACH, "[[]*[]]")) for p in prefixes for pat in self.ignore):
                continue        # an ignore pattern's `[*]`: each element of a list read per element
            unknown.append(f"{shown_path}={value!r}" if not isinstance(value, (list, dict)) or len(repr(value)) < 60
                           else shown_path)
        if unknown:
            shown = ", ".join(unknown[:6]) + (f" (and {len(unknown) - 6} more)" if len(unknown) > 6 else "")
            raise self.error(f"does not model config.json field(s) {shown}: the spec neither reads them nor declares "
                             f"them (config_assume / config_ignore), so this checkpoint could be served wrong")
        return self.values


_ARTICLE = {"int": "an int", "float": "a finite number", "bool": "a bool (true / false)", "str": "a string",
            "int_tuple": "a list of ints", "float_tuple": "a list of numbers", "str_tuple": "a list of strings",
            "bool_tuple": "a list of bools"}
_ITEM_OK = {"int_tuple": _is_int, "float_tuple": lambda x: _is_num(x) and math.isfinite(x),
            "str_tuple": lambda x: isinstance(x, str), "bool_tuple": lambda x: isinstance(x, bool)}


def _short_repr(v: Any) -> str:
    r = repr(v)
    return r if len(r) < 80 else r[:76] + " ..."


def _json_float(v: Any) -> Any:
    """transformers 5 writes a non-finite float of a config as {"__float__": "Infinity"} (json cannot hold it)."""
    if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "-Infinity", "NaN"):
        return float(v["__float__"].lower().replace("infinity", "inf"))
    return v


def _same(a: Any, b: Any) -> bool:
    a, b = _json_float(a), _json_float(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_num(a) and _is_num(b):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
