"""Spec errors: every one names the spec file, line and column of the offending YAML node."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Location:
    file: str
    line: int      # 1-based
    column: int    # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class SpecError(Exception):
    """One error in a spec, at a location. `str()` is the full `file:line:col: error: ...` line."""

    def __init__(self, message: str, location: Optional[Location] = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        return f"{where}error: {self.message}"


class SpecErrors(Exception):
    """Several errors found in one pass (e.g. all schema errors of a spec), sorted by location."""

    def __init__(self, errors: Iterable[SpecError]):
        self.errors = sorted(errors, key=lambda e: (e.location.file, e.location.line, e.location.column)
                             if e.location else ("", 0, 0))
        super().__init__("\n".join(str(e) for e in self.errors))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest candidate, or '' when none is close."""
    matches = difflib.get_close_matches(str(word), sorted(set(map(str, candidates))), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""
