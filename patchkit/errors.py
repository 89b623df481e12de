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


class ManifestError(PatchkitError):
    """A manifest (or a file given as one) is not valid; carries every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class PatchError(PatchkitError):
    """Applying a plan failed; names the entry. Every entry of the run was rolled back."""

    def __init__(self, entry_id: str, reason: str) -> None:
        self.entry_id = entry_id
        self.reason = reason
        super().__init__(f"patch entry {entry_id!r} failed: {reason}")


class UnsupportedRelease(PatchkitError):
    """No manifest supports the running vLLM release."""
