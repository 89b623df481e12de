"""The project's own error types: every failure a user can cause ends in one of these.

``ManifestError`` always names a file, a line and a field, and prints as
``file:line: field: message`` so editors and CI annotate the right place.
``PatchError`` names the manifest entry that failed and why.
"""

from __future__ import annotations

from typing import Any


class PatchkitError(Exception):
    """Base of every error patchkit raises on purpose."""


MAX_PROBLEMS = 50


class ManifestError(PatchkitError):
    """A manifest (or a file given as one) is not valid.

    Carries the first ``MAX_PROBLEMS`` problems found (``problems``: ``patchkit.manifest.problems.Problem``,
    each printing as ``file:line: field: message``) and how many more there were (``more``); the message
    says "... and N more problems"."""

    def __init__(self, problems: list[Any], more: int = 0) -> None:
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
