"""Writes generated files only when they changed; `check` diffs them instead of writing."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Dict, List, Tuple

from .yaml_loader import display_path

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATED_DIR = REPO_ROOT / "generated"


def output_dir(name: str, out_root: Path | None = None) -> Path:
    return (Path(out_root) if out_root else GENERATED_DIR) / name


def write(files: Dict[str, str], directory: Path) -> List[Tuple[Path, bool]]:
    """Writes each file whose content differs; returns [(path, written)]."""
    directory.mkdir(parents=True, exist_ok=True)
    result = []
    for name, text in files.items():
        path = directory / name
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        if old != text:
            path.write_text(text, encoding="utf-8")
        result.append((path, old != text))
    return result


def check(files: Dict[str, str], directory: Path) -> List[str]:
    """Unified diffs (current file -> what the spec generates) of every stale or hand-edited file."""
    diffs = []
    for name, text in files.items():
        path = directory / name
        old = path.read_text(encoding="utf-8") if path.is_file() else ""
        if old != text:
            shown = display_path(path)
            diffs.append("".join(difflib.unified_diff(
                old.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{shown} (on disk)" if path.is_file() else f"{shown} (missing)",
                tofile=f"{shown} (generated)")))
    return diffs
