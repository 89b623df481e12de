"""Findings in a manifest file, and the field paths that locate them."""

from __future__ import annotations

from dataclasses import dataclass

FieldPath = tuple[str | int, ...]


def field_name(path: FieldPath) -> str:
    """``("patches", 2, "op")`` → ``patches[2].op``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding in one manifest file; prints as ``file:line: field: message``, with what UTF-8 cannot encode
    (a lone surrogate a YAML escape made, in a key or a value) escaped as ``\\udXXX``, so every log, terminal and
    report can carry it."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        text = f"{self.file}:{self.line}: {self.field or '<document>'}: {self.message}"
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
