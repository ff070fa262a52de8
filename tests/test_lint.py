"""ruff (pyproject.toml [tool.ruff]: pyflakes, pycodestyle, import order) is clean on the compiler, the runtime
and what the compiler generates: a template change that renders an unused import or an undefined name fails
here, not in a user's editor."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "--no-cache", "codegen", "runtime", "generated", "bench", "tests"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
