"""The project's own error types: every failure a user can cause ends in one of these.

``ManifestError`` always names a file, a line and a field, and prints as
``file:line: field: message`` so editors and CI annotate the right place.
``PatchError`` names the manifest entry that failed and why.
"""

from __future__ import annotations

from patchkit.records import Record

FieldPath = tuple[str | int, ...]


def field_name(path: FieldPath) -> str:
    """``("patches", 2, "op")`` → ``patches[2].op``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class Problem(Record):
    """One finding in one manifest file: ``Problem(file, line, field, message)``."""

    _fields = ("file", "line", "field", "message")
    __slots__ = _fields
    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field or '<document>'}: {self.message}"


class PatchkitError(Exception):
    """Base of every error patchkit raises on purpose."""


MAX_PROBLEMS = 50


class ManifestError(PatchkitError):
    """A manifest (or a file given as one) is not valid.

    Carries the first ``MAX_PROBLEMS`` problems found (``problems``) and how many
    more there were (``more``); the message says "... and N more problems"."""

    def __init__(self, problems: list[Problem], more: int = 0) -> None:
        self.problems = list(problems[:MAX_PROBLEMS])
        self.more = more + max(0, len(problems) - MAX_PROBLEMS)
        tail = [f"... and {self.more} more problems"] if self.more else []
        super().__init__("\n".join([*(str(p) for p in self.problems), *tail]))


class PatchError(PatchkitError):
    """Applying a plan failed; names the entry. Every entry of the run was rolled back."""

    def __init__(self, entry_id: str, reason: str) -> None:
        self.entry_id = entry_id
        self.reason = reason
        super().__init__(f"patch entry {entry_id!r} failed: {reason}")


class UnsupportedRelease(PatchkitError):
    """No manifest supports the running vLLM release."""
