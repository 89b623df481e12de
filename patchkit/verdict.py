"""The verdict on one manifest against one vLLM tree: data only, decided once, read by every process.

``patchkit.judge.judge(manifest, tree)`` makes it: every member of the manifest (patch entries, the workers
entry, model registrations, requirements) judged with ``patchkit check``'s rules, deferred members included.
Then the feature is the unit: a failing member with a ``feature`` refuses that feature, and every member of
a refused feature is left out (``feature-off``); a failing member without one refuses the plugin, and
nothing of it is applied. ``check`` takes its exit code and its "features refused" from this object,
``plan``/``retarget`` print it, and the runtime stores it with the compiled plan (``Compiled.verdict``), so
the API server, the engine core and every worker apply the same one.

``inputs`` records what the judge read of the tree (each file's size and modification time, the module
paths it found absent), so a process that reads a stored verdict re-stats those paths: a changed tree is
a miss (``stale``), never a silent disagreement.

Kept free of imports beyond the standard library: the plugin hook reads it in every vLLM process.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

_MEMBER_FIELDS = ("id", "kind", "target", "verdict", "fails", "feature", "reason", "where")


class Member:
    """One member's result. ``id``: the entry id, ``model:<arch>`` or ``require:<target>``; ``verdict``: the
    static verdict of its target (``ok``, ``drifted: body``, ``missing``, ``unjudged: …``; a callable that does
    not fit shows in ``reason``); ``fails``: whether it fails by the manifest's policy (required,
    ``on_drift: fail``, or a callable that does not fit); ``reason``: the words for logs and errors;
    ``where``: ``file:line`` in the tree, when found.

    Plain slotted classes, not dataclasses: every vLLM process imports this module in the plugin hook, and
    each method ``@dataclass`` generates costs an ``exec`` (``patchkit.plan._Record`` says how much)."""

    __slots__ = _MEMBER_FIELDS

    def __init__(self, id: str, kind: str, target: str, verdict: str, fails: bool,
                 feature: str | None = None, reason: str = "", where: str | None = None) -> None:
        self.id, self.kind, self.target, self.verdict = id, kind, target, verdict
        self.fails, self.feature, self.reason, self.where = fails, feature, reason, where

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _MEMBER_FIELDS}

    def __repr__(self) -> str:
        return f"Member({self.id!r}, {self.verdict!r}, fails={self.fails}, feature={self.feature!r})"


class Verdict:
    """See the module docstring. ``features``: every declared feature → its "without it" words;
    ``tree``: what was judged (for messages); ``inputs``: (path, size, mtime_ns) of what was read, size -1 for
    a path that must stay absent."""

    __slots__ = ("_refused", "features", "inputs", "manifest", "members", "tree")

    def __init__(self, manifest: str, tree: str, members: tuple[Member, ...], features: dict[str, str] | None = None,
                 inputs: tuple[tuple[str, int, int], ...] = ()) -> None:
        self.manifest, self.tree, self.members = manifest, tree, members
        self.features = dict(features or {})
        self.inputs = inputs
        self._refused: dict[str, list[str]] | None = None  # computed once (``refused``): read per member at start

    def __repr__(self) -> str:
        return f"Verdict({os.path.basename(self.manifest)!r}, holds={self.holds}, refused={sorted(self.refused)})"

    # -- the decisions ------------------------------------------------------------------------------
    @property
    def refused(self) -> dict[str, list[str]]:
        """Each refused feature → the ids of its failing members (file order)."""
        if self._refused is None:
            out: dict[str, list[str]] = {}
            for m in self.members:
                if m.fails and m.feature is not None:
                    out.setdefault(m.feature, []).append(m.id)
            self._refused = out
        return self._refused

    @property
    def plugin_failures(self) -> list[Member]:
        """The failing members without a feature: any one refuses the plugin."""
        return [m for m in self.members if m.fails and m.feature is None]

    @property
    def holds(self) -> bool:
        """True when the plugin is not refused (features may be)."""
        return not self.plugin_failures

    def off(self, feature: str | None) -> bool:
        """Whether members of ``feature`` are left out (``None``: the plugin's own members: never)."""
        return feature is not None and feature in self.refused

    def refusal(self, feature: str | None = None) -> str | None:
        """The words that refuse ``feature`` (``None``: the plugin), or None when it is not refused: which
        members fail and why, and, for a feature, how to run without it (the manifest's ``features``). A feature
        the manifest does not declare raises ``ValueError``: code that names one fails loudly on a rename."""
        if feature is not None and feature not in self.features:
            raise ValueError(f"feature {feature!r} is not declared in {os.path.basename(self.manifest)} "
                             f"(declared: {', '.join(sorted(self.features)) or 'none'})")
        failing = self.plugin_failures if feature is None else [
            m for m in self.members if m.fails and m.feature == feature]
        if not failing:
            return None
        what = "the plugin" if feature is None else f"feature {feature!r}"
        causes = "; ".join(f"{m.id} ({m.target}): {m.reason or m.verdict}" for m in failing[:5])
        more = f"; and {len(failing) - 5} more" if len(failing) > 5 else ""
        words = (f"{what} is refused on {self.tree} by {os.path.basename(self.manifest)}: {causes}{more}")
        if feature is not None and self.features.get(feature):
            words += f". Without it: {self.features[feature]}"
        return words

    def summary(self) -> dict[str, Any]:
        """``{"holds", "features_refused", "plugin_failures", "digest"}``: what reports compare across processes."""
        return {"holds": self.holds, "features_refused": self.refused,
                "plugin_failures": [m.id for m in self.plugin_failures], "digest": self.digest}

    @property
    def digest(self) -> str:
        """A short hash over every member's result (not the inputs): equal digests, equal decisions."""
        rows = [[m.id, m.verdict, m.fails, m.feature] for m in self.members]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    # -- staleness ------------------------------------------------------------------------------------
    def stale(self) -> str | None:
        """Why the tree this verdict read has changed since (a file's size or time, an absent module now
        present), or None. One ``stat`` per input."""
        for path, size, mtime in self.inputs:
            try:
                st = os.stat(path)
            except OSError:
                if size >= 0:
                    return f"{path} is gone"
                continue
            if size < 0:
                return f"{path} appeared"
            if st.st_size != size or st.st_mtime_ns != mtime:
                return f"{path} changed"
        return None

    # -- JSON (the plan cache) -------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "tree": self.tree, "members": [m.to_json() for m in self.members],
                "features": dict(self.features), "inputs": [list(i) for i in self.inputs]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        """The inverse of ``to_json``; TypeError/KeyError/ValueError on a wrong shape (the cache's miss)."""
        members = tuple(Member(**m) for m in data["members"])
        for m in members:
            if not (isinstance(m.id, str) and isinstance(m.fails, bool)
                    and (m.feature is None or isinstance(m.feature, str))):
                raise ValueError("malformed member")
        inputs = tuple((str(p), int(s), int(t)) for p, s, t in data["inputs"])
        features = {str(k): str(v) for k, v in data["features"].items()}
        return cls(str(data["manifest"]), str(data["tree"]), members, features, inputs)
