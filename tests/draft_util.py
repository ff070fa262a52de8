"""What the drafting tool's tests share: a class drafted by name (once per session), its checklist, and drafts of
tiny checkpoints for the verify arms."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml

_TEXT: dict = {}


def draft_by_name(target: str) -> tuple[str, dict]:
    """(text, doc) of `xllm-gen draft TARGET` for a class name; drafted once per session, a fresh doc per call."""
    from xllm_gen.codegen.draft import draft_spec
    if target not in _TEXT:
        _TEXT[target] = draft_spec(target)[0]
    return _TEXT[target], yaml.safe_load(_TEXT[target])


def checklist(text: str) -> str:
    """The draft's open checklist items."""
    return "\n".join(line for line in text.splitlines() if line.startswith("# - [ ]"))


def drafts_of_checkpoints(tiny_checkpoint, root: Path, cases: Callable) -> Callable:
    """get(case) -> (tiny checkpoint dir, drafted spec path), each built once; `cases(case)` -> (architecture,
    config overrides)."""
    from xllm_gen.codegen.draft import draft_spec
    cache: dict = {}

    def get(case):
        if case not in cache:
            arch, overrides = cases(case)
            ckpt = tiny_checkpoint(arch, overrides=overrides or None)
            spec = root / f"{case}.yaml"
            spec.write_text(draft_spec(str(ckpt))[0])
            cache[case] = (ckpt, spec)
        return cache[case]
    return get
