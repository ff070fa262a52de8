"""The spec resolver's `config` section (a mixin of resolver._Resolver): the config symbols (`resolve_config`),
their defaults and bounds (`check_defaults`, `imply_bounds`, `check_value`), the symbols' dependency cycles
(`check_cycles`) and the config guard (`resolve_guard`: config_assume / config_defaults / config_ignore)."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict

from xllm_gen.runtime.rope_kinds import ROPE_SCALING_KEYS, ROPE_SHARED_KEYS  # pure Python: each type's keys

from .errors import did_you_mean
from .ir import (
    ConfigFieldIR,
    Size,
)
from .resolver_blocks import _is_int
from .resolver_variants import MAX_SIZE, _is_num, _type_ok

# rope types as transformers names them (modeling_rope_utils); the runtime Rotary computes each
# transformers' rope_type names (what config.json carries) -> the rotary primitive's scaling kinds
# (runtime/rope_kinds.py); a spec's `type: rope` symbol lists the names it models.
HF_ROPE_TYPES = {"default": "default", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn",
                 "llama3": "frequency_bands", "longrope": "longrope", "proportional": "proportional"}
ROPE_TYPES = tuple(HF_ROPE_TYPES)


class ConfigResolver:
    def resolve_config(self) -> None:
        pending = []
        for name, f in self.spec.config.items():
            path = ("config", name)
            self.ident(path, name, "config symbol", at_key=True)
            if name in ("layer", "config") or name in ("len", "min", "max", "int", "float", "bool", "round", "range"):
                raise self.err(path, f"config.{name}: '{name}' is reserved in spec expressions", at_key=True)
            if f.values is not None:
                if f.type not in ("str", "str_tuple", "rope"):
                    raise self.err(path + ("values",), f"config.{name}.values: only str, str_tuple (each entry) and "
                                                       f"rope symbols take values")
                if not f.values or len(set(f.values)) != len(f.values):
                    raise self.err(path + ("values",), f"config.{name}.values: list the admitted values, each once")
                if f.type == "rope":
                    for i, v in enumerate(f.values):
                        if v not in ROPE_TYPES:
                            raise self.err(path + ("values", i), f"config.{name}.values[{i}]: unknown rope type "
                                                                 f"'{v}'{did_you_mean(v, ROPE_TYPES)}; known: "
                                                                 f"{', '.join(ROPE_TYPES)}")
                for alias, target in (f.aliases or {}).items():
                    if f.type != "rope":
                        raise self.err(path + ("aliases",), f"config.{name}.aliases: only rope symbols take aliases")
                    # an alias may be another family's rope type (Phi3Config reads `yarn` as longrope), never a value
                    if alias in f.values:
                        raise self.err(path + ("aliases", alias), f"config.{name}.aliases.{alias}: '{alias}' is one of "
                                                                  f"the symbol's values already", at_key=True)
                    if target not in f.values:
                        raise self.err(path + ("aliases", alias), f"config.{name}.aliases.{alias}: '{target}' is not "
                                                                  f"one of the symbol's values ({', '.join(f.values)})")
            elif f.aliases:
                raise self.err(path + ("aliases",), f"config.{name}.aliases: give the `values` the aliases name")
            elif f.type == "rope":
                raise self.err(path, f"config.{name}: a rope symbol lists the rope types the spec models: "
                                     f"`values: [default, ...]`", at_key=True)
            for key in ("min", "max"):
                bound = getattr(f, key)
                if bound is not None and (f.type not in ("int", "float") or not math.isfinite(bound)):
                    raise self.err(path + (key,), f"config.{name}.{key}: bounds are finite numbers of int / float "
                                                  f"symbols")
            if f.truthy and (f.type != "bool" or f.expr is not None):
                raise self.err(path + ("truthy",), f"config.{name}.truthy: only a bool symbol read from config.json "
                                                   f"reads an int as its truth value")
            if f.present and (f.type != "bool" or f.expr is not None or f.default is not None or f.optional
                              or f.default_expr is not None or f.truthy or isinstance(f.from_, list)):
                raise self.err(path + ("present",), f"config.{name}.present: only a bool symbol with one `from` path "
                                                    f"and no default / optional / truthy tells a field's presence")
            if f.read_if is not None and (f.expr is not None or f.present or f.type == "rope"
                                          or not (f.default is not None or f.default_expr is not None or f.optional)):
                raise self.err(path + ("read_if",), f"config.{name}.read_if: only a symbol read from config.json (not "
                                                    f"`present`, not rope) with a default or `optional` (its value "
                                                    f"where the field is not read)")
            if f.same_meaning and f.expr is not None:
                raise self.err(path + ("same_meaning",), f"config.{name}.same_meaning: a derived symbol reads no field "
                                                         f"to compare with transformers' class")
            if f.guard and f.values is None and f.min is None and f.max is None:
                raise self.err(path + ("guard",), f"config.{name}.guard: a guard-only symbol restricts its field: give "
                                                  f"`values`, `min` or `max` (a fixed value is `config_assume`)")
            if f.expr is not None:
                if (f.from_ is not None or f.default is not None or f.default_expr is not None
                        or f.if_null is not None):
                    raise self.err(path + ("expr",), f"config.{name}: a derived symbol (`expr`) reads no config.json "
                                                     f"field: drop `from` / `default` / `if_null`")
                pending.append((name, f, path))
                self.config[name] = ConfigFieldIR(name, f.type, (), None, False, f.doc.strip(), expr=True,
                                                  optional=f.optional, values=tuple(f.values) if f.values else None,
                                                  bounds=(f.min, f.max), guard=f.guard)
                continue
            if f.from_ is None:
                raise self.err(path, f"config.{name}: missing required key 'from' (or `expr` for a derived "
                                     f"symbol)", at_key=True)
            paths = (f.from_,) if isinstance(f.from_, str) else tuple(f.from_)
            # a `*` part (not first, not last) reads every key of a mapping, which must all hold one value (transformers'
            # per_layer_config.<layer>.head_dim); a `name[*]` part reads a field of every element of the list `name`
            # into a tuple (Nemotron-NAS's block_configs[*].attention.no_op)
            if not paths or any(not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\[\*\])?(\.([A-Za-z_][A-Za-z0-9_]*(\[\*\])?|\*))*$",
                                             p) or p.endswith(".*") for p in paths):
                raise self.err(path + ("from",), f"config.{name}.from: give one or more dotted config.json paths")
            self.check_each_read(path, name, f, paths)
            if f.default is not None and f.default_expr is not None:
                raise self.err(path + ("default_expr",), f"config.{name}: give `default` or `default_expr`, not both")
            default = f.default
            if default is not None:
                if not _type_ok(f.type, default):
                    raise self.err(path + ("default",), f"config.{name}.default: {default!r} is not {f.type}")
                if f.type == "float":
                    default = float(default)
                if f.type.endswith("_tuple"):
                    default = tuple(default)
            has_default = default is not None or f.optional or f.default_expr is not None or f.type == "rope" or f.present
            if f.if_null is not None and (f.optional or f.present or f.type == "rope"):
                raise self.err(path + ("if_null",), f"config.{name}.if_null: an optional symbol reads null as None, a "
                                                    f"rope symbol as the default rope; `if_null` is for the others")
            if f.default_expr is not None or f.if_null is not None or f.read_if is not None:
                pending.append((name, f, path))
            self.config[name] = ConfigFieldIR(
                name, f.type, paths, default, has_default, f.doc.strip(), item_default=f.item_default,
                values=tuple(f.values) if f.values else None, optional=f.optional, bounds=(f.min, f.max),
                guard=f.guard, aliases=tuple((f.aliases or {}).items()), truthy=f.truthy, present=f.present,
                same_meaning=f.same_meaning.strip())
            if default is not None:
                self.check_value(path + ("default",), f"config.{name}.default", self.config[name], default)
                if f.type == "rope":
                    self.check_rope_default(path + ("default",), name, f, default)
        for name, f, path in pending:       # expressions may name symbols declared after them
            for key in ("expr", "default_expr", "if_null", "read_if"):
                if getattr(f, key) is None:
                    continue
                src = getattr(f, key)
                e = self.expr(path + (key,), src if isinstance(src, str) else repr(src))   # if_null: 2, false
                if name in e.names:
                    raise self.err(path + (key,), f"config.{name}.{key}: a symbol cannot refer to itself")
                self.config[name] = dataclasses.replace(self.config[name], **{key: e})
        self.check_cycles()
        self.resolve_guard()
        ctx = self.config.get("max_position_embeddings")
        if ctx is None or ctx.type != "int":       # the engine reads the context length by this name
            where = ("config", "max_position_embeddings") if ctx is not None else ("config",)
            raise self.err(where, "config.max_position_embeddings: the engine reads the context length (the default "
                                  "max_model_len) from an int symbol of this name; a family without a position "
                                  "table still has one: read its config field (e.g. `from: seq_length`) or state "
                                  "one (`expr: \"2048\"`)", at_key=True)

    def check_each_read(self, path, name: str, f, paths) -> None:
        """`from: list[*].field`: a tuple symbol, one entry per element; one `[*]` per path, followed by the element's
        field, no `*` part beside it. `item_default` (an element's absent / null field) only there, of the item type."""
        each = [p for p in paths if "[*]" in p]
        if f.item_default is not None and not each:
            raise self.err(path + ("item_default",), f"config.{name}.item_default: only a per-element read "
                                                     f"(`from: list[*].field`) has items")
        if not each:
            return
        if not f.type.endswith("_tuple"):
            raise self.err(path + ("type",), f"config.{name}.type: '{each[0]}' reads one value per element of a "
                                             f"list: the symbol is a tuple (int_tuple, float_tuple, str_tuple, "
                                             f"bool_tuple), not {f.type}")
        for p in each:
            head, rest = p.split("[*]", 1)
            if "[*]" in rest or ".*" in p or not rest.startswith("."):
                raise self.err(path + ("from",), f"config.{name}.from: '{p}': one `[*]` per path, followed by the "
                                                 f"field of each element (`list[*].field`), no `*` part beside it")
        if f.present or f.read_if is not None or f.if_null is not None:
            raise self.err(path + ("from",), f"config.{name}: a per-element read takes no `present` / `read_if` / "
                                             f"`if_null` (an element's null field: `item_default` or `optional`)")
        if f.item_default is not None and not _type_ok(f.type, [f.item_default]):
            raise self.err(path + ("item_default",), f"config.{name}.item_default: {f.item_default!r} is not an item "
                                                     f"of a {f.type}")

    def check_defaults(self) -> None:
        """A literal `default` of a symbol used as a size, or as a positive number (eps, theta, scale, ...), is
        in range: a checkpoint without the field gets it, whatever the variants set."""
        def bad(sym, ok, what):
            f = self.config.get(sym) if sym else None
            if f is None or f.default is None or isinstance(f.default, (tuple, dict, str, bool)):
                return
            if not ok(f.default):
                raise self.err(("config", sym, "default"), f"config.{sym}.default: {f.default!r}; {what}")

        for _, size in self.sizes:
            bad(getattr(size, "symbol", None) if isinstance(size, Size) else None,
                lambda x: _is_int(x) and 0 < x <= MAX_SIZE, "it is used as a size (an int in 1..2**31-1)")
        for _, v in self.positives:
            bad(v.symbol, lambda x: _is_num(x) and x > 0, "it is used where a number must be > 0")
        for _, v, bound in self.below:
            bad(v.symbol, lambda x, b=bound: _is_num(x) and x < b, f"it is used where a number must be < {bound}")

    def imply_bounds(self) -> None:
        """An int symbol read from config.json and used as a size gets the bounds [1, 2**31-1] (narrowed by
        its own min / max), checked when a checkpoint is loaded: a config.json with a zero or negative size
        is refused naming the field, before any tensor is built."""
        for _, size in self.sizes:
            sym = getattr(size, "symbol", None) if isinstance(size, Size) else None
            f = self.config.get(sym) if sym else None
            if f is None or f.derived or f.type != "int":
                continue
            lo, hi = f.bounds
            bounds = (1 if lo is None else max(lo, 1), MAX_SIZE if hi is None else min(hi, MAX_SIZE))
            if bounds != tuple(f.bounds):
                self.config[sym] = dataclasses.replace(f, bounds=bounds)
        # a number used where it must be > 0 (norm eps, rope theta, scales, soft-caps): a config.json with 0 or
        # a negative value is refused naming the field, instead of serving NaN or a silently wrong model
        for _, v in self.positives:
            sym = getattr(v, "symbol", None)
            f = self.config.get(sym) if sym else None
            if f is not None and not f.derived and f.type in ("int", "float") and not f.positive:
                self.config[sym] = dataclasses.replace(f, positive=True)
        # a symbol an expression divides by (resolver_symbols._divisors): > 0 too, where its bounds do not say so
        for _, v in self.divisors:
            f = self.config.get(v.symbol)
            if f is not None and not f.derived and f.type in ("int", "float") and not f.positive \
                    and not (f.bounds[0] is not None and f.bounds[0] > 0):
                self.config[v.symbol] = dataclasses.replace(f, positive=True)

    def check_cycles(self) -> None:
        """Derived symbols and default expressions form no cycle."""
        deps = {n: {x for e in (f.expr, f.default_expr, f.if_null, f.read_if) if e is not None for x in e.names}
                for n, f in self.config.items()}
        state: Dict[str, int] = {}

        def visit(n, chain):
            if state.get(n) == 2:
                return
            if state.get(n) == 1:
                raise self.err(("config", n), f"config.{n}: expressions form a cycle: {' -> '.join(chain + [n])}",
                               at_key=True)
            state[n] = 1
            for d in sorted(deps.get(n, ())):
                visit(d, chain + [n])
            state[n] = 2

        for n in self.config:
            visit(n, [])

    def check_rope_default(self, path, name: str, f, default) -> None:
        """A rope symbol's default mapping, read as the generated Config reads a checkpoint's (the runtime's rope
        reader: its keys per rope type, required keys, positive numbers), so that a bad default is this spec's
        error here, not a config.json error at the first variant or checkpoint that leaves the field out."""
        from xllm_gen.runtime.loading.hf_config import ConfigError, ConfigReader
        types = {v: HF_ROPE_TYPES[v] for v in f.values or ()}
        types.update({a: HF_ROPE_TYPES[t] for a, t in (f.aliases or {}).items()})
        where = f"config.{name}.default"
        reader = ConfigReader({"max_position_embeddings": 1}, "")
        try:
            reader.rope(where, default, types)
            error = None
        except ConfigError as e:
            error = str(e).split(": ", 1)[-1].replace("config.json field ", "").replace(f"'{where}.", "'")
        rope_type = default.get("rope_type", default.get("type", "default")) if isinstance(default, dict) else None
        required, optional = ROPE_SCALING_KEYS.get(types.get(rope_type), ((), ()))
        known = required + optional
        for key in default if isinstance(default, dict) else ():
            if key not in known and key not in ROPE_SHARED_KEYS:
                raise self.err(path, f"{where}: rope type '{rope_type}' has no key '{key}'"
                                     f"{did_you_mean(key, known)} (it reads: {', '.join(known) or 'nothing'})")
        for key in required:
            if key not in default:
                raise self.err(path, f"{where}: rope type '{rope_type}' needs '{key}'")
        if error:
            raise self.err(path, f"{where}: {error}")

    def check_value(self, path, where: str, f: ConfigFieldIR, value, at_key: bool = False) -> None:
        """A str / rope value (each entry of a str_tuple) against the symbol's admitted values, and numbers against
        its bounds."""
        if f.values and value is not None:
            v = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
            for x in (v if isinstance(v, (list, tuple)) else (v,)):    # a str_tuple: each entry
                if x not in f.values:
                    raise self.err(path, f"{where}: {x!r} is not one of the values the spec models: "
                                         f"{', '.join(f.values)}", at_key=at_key)
        lo, hi = f.bounds
        if value is not None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            raise self.err(path, f"{where}: {value!r} is outside [{lo}, {hi}]", at_key=at_key)

    def resolve_guard(self) -> None:
        """config_assume / config_ignore: the fields the spec does not read are declared."""
        read = {p for f in self.config.values() for p in f.paths}
        for key, value in self.spec.config_assume.items():
            path = ("config_assume", key)
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\[\*\])?(\.[A-Za-z_][A-Za-z0-9_]*(\[\*\])?)*$", key) \
                    or key.count("[*]") > 1 or key.endswith("[*]"):
                raise self.err(path, f"config_assume: '{key}' is not a dotted config.json path (`list[*].field`: "
                                     f"that field of each element)", at_key=True)
            if key in read:
                raise self.err(path, f"config_assume.{key}: this field is read by a config symbol; a field is "
                                     f"either read or assumed", at_key=True)
            if isinstance(value, dict) and "any_of" in value:     # left over by AssumeAnyOf: no value in it
                raise self.err(path + ("any_of",), f"config_assume.{key}.any_of: list the values transformers treats "
                                                   f"alike (at least one)")
        for key in self.spec.config_defaults:
            if "[*]" in key:
                raise self.err(("config_defaults", key), f"config_defaults.{key}: an element's absent field is its "
                                                         f"config class's default; assume that value", at_key=True)
            if key not in self.spec.config_assume:
                where = "read by a config symbol: state its default with the symbol's `default`" if key in read \
                    else "not in config_assume: list the value the spec assumes there"
                raise self.err(("config_defaults", key), f"config_defaults.{key}: this field is {where}", at_key=True)
        for i, pat in enumerate(self.spec.config_ignore):
            if not pat or not re.match(r"^[A-Za-z0-9_.*?\[\]]+$", pat):
                raise self.err(("config_ignore", i), f"config_ignore[{i}]: '{pat}' is not a dotted path pattern")
