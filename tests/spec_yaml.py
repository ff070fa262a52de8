"""Spec files read as YAML by the test batteries, parsed once per session.

Collection reads every specs/*.yaml several times (the spec battery's cases, the conformance battery's plans and
toggles); with PyYAML's pure-Python loader that was minutes on two cores. `read_yaml(path)` is `yaml.safe_load` of
the file with libyaml's safe loader where PyYAML has it, cached per (path, mtime), a fresh copy per call.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, mtime_ns: int) -> Any:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def read_yaml(path: Path) -> Any:
    """yaml.safe_load of a spec file, parsed once per session (libyaml's loader where PyYAML has it: collection
    reads every spec several times, which the pure-Python loader made minutes); a fresh copy per call."""
    path = Path(path)
    return copy.deepcopy(_parsed(path, path.stat().st_mtime_ns))
