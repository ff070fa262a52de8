"""The compiler pipeline as functions: spec path -> (loaded spec, IR, rendered files)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from .ir import ModelIR
from .loader import LoadedSpec, load_spec
from .render import render
from .resolver import resolve


@dataclass
class Compiled:
    loaded: LoadedSpec
    ir: ModelIR
    files: Dict[str, str]


def compile_spec(path) -> Compiled:
    """Loads, validates, resolves and renders one spec; raises SpecError/SpecErrors on a bad spec."""
    loaded = load_spec(Path(path))
    ir = resolve(loaded)
    return Compiled(loaded, ir, render(ir, loaded.tree))
