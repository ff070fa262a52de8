"""docs/coverage.md is what `python -m tests.conformance.coverage` writes for the installed transformers and
the specs in specs/ (no model runs: the enumeration, the specs and their config guards)."""
from __future__ import annotations

from conformance import coverage


def test_coverage_md_is_up_to_date():
    assert coverage.COVERAGE.is_file(), "docs/coverage.md is missing: run python -m tests.conformance.coverage"
    assert coverage.COVERAGE.read_text(encoding="utf-8") == coverage.render(), (
        "docs/coverage.md is stale (a spec was added or changed): run python -m tests.conformance.coverage")
