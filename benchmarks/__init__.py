"""Rerunnable scripts behind the README's figures; run each from the repository root as
``python -m benchmarks.NAME`` (so ``harness`` is importable without path edits)."""
