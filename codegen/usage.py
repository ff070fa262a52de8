"""The static check that every config symbol a spec reads reaches the generated model.

A symbol read from config.json that no generated expression uses would be accepted at load and ignored: a
checkpoint whose value differs from what the model computes would be served wrong (a spec that reads
`sliding_window` but gives no block a window). The check reads the rendered modules themselves, so it cannot
drift from what is served: a symbol is used when the generated code reads `config.<symbol>` outside the Config
class, when the runtime reads it by name (RUNTIME_READS: eos ids, context length, vocab size, hidden size), or
when a used symbol's expression (`expr`, `default_expr`) reads it. A guard-only symbol (`guard: true`, with
`values` / `min` / `max`) is exempt: its purpose is the check at load.
"""
from __future__ import annotations

import re
from typing import Dict, Set

from xllm_gen.runtime.loading.hf_config import RUNTIME_READS

from .errors import SpecError
from .ir import ModelIR
from .loader import LoadedSpec

_READ = re.compile(r"\bconfig\.([A-Za-z_][A-Za-z0-9_]*)")


def _outside_config_class(source: str, cfg_class: str) -> str:
    """The module source without the Config dataclass (its fields and from_hf name every symbol)."""
    out, skipping = [], False
    for line in source.splitlines():
        if line.startswith(f"class {cfg_class}"):
            skipping = True
            continue
        if skipping and line and not line[0].isspace() and not line.startswith(("#", ")")):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def used_symbols(ir: ModelIR, files: Dict[str, str]) -> Set[str]:
    """The config symbols the generated model, its runner or the runtime read (closed over expressions)."""
    cfg = f"{ir.class_prefix}Config"
    names = {f.name for f in ir.config}
    used: Set[str] = set()
    for fname in ("model.py", "runner.py"):
        used |= {m for m in _READ.findall(_outside_config_class(files.get(fname, ""), cfg)) if m in names}
    used |= names & RUNTIME_READS
    fields = {f.name: f for f in ir.config}
    todo = list(used) + [f.name for f in ir.config if f.guard]
    seen = set(todo)
    while todo:                       # a used (or guard) symbol's expressions read other symbols
        f = fields[todo.pop()]
        for e in (f.expr, f.default_expr, f.if_null, f.read_if):
            for n in (e.names if e is not None else ()):
                if n in fields and n not in seen:
                    seen.add(n)
                    used.add(n)
                    todo.append(n)
    return used


def check_symbols_used(loaded: LoadedSpec, ir: ModelIR, files: Dict[str, str]) -> None:
    used = used_symbols(ir, files)
    for f in ir.config:
        if f.name in used or f.guard:
            continue
        what = f"reads config.json {' / '.join(f.paths)}" if f.paths else f"is derived ({f.expr})"
        raise SpecError(
            f"config.{f.name}: {what} but no block uses it: it would be accepted and ignored, so a checkpoint "
            f"with another value would be served wrong. Use it in the block it configures, declare it guard-only "
            f"(`guard: true` with `values` / `min` / `max`), or fix its value in `config_assume`",
            loaded.tree.smap.key(("config", f.name)))
