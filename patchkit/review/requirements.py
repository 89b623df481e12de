"""Run-time verdicts of a manifest's ``requires:``: does the running vLLM still have what the plugin relies on?

patchkit only reports; the plugin decides what a drifted requirement means for it
(afd refuses to start AFD, a run without AFD is untouched). A requirement may name the one
``feature`` of the plugin that needs it; ``refusing(results, feature)`` then sorts the failing
verdicts: those without a feature refuse the plugin, those with one refuse that feature only. A
feature is a string the manifest declares; what it means, and when a run asks for it, is the plugin's.
``verdicts(manifest)`` judges each requirement against the source of the vLLM this process imports, with
the static model of ``patchkit.static`` — the same resolver, fingerprints and pin
rules as ``patchkit check``, so the two never disagree — and without importing a
single target module: a requirement on a GPU worker is judged on a CPU machine
too, and no vLLM module runs code because it was checked.

Cost: the tree is indexed (one directory walk) and only files that name a
required symbol are parsed; about a quarter of a second for the afd manifest
(docs/benchmarks.md). Nothing here runs in the plugin hook; ``Status.requirements``
calls ``of_status`` on first access, and the result is kept per manifest digest.

Limits: those of the static model (names built at run time, module
``__getattr__`` hooks are not seen); a vLLM tree that cannot be read gives every
requirement the verdict ``unreadable: <why>``, which fails like a drift.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import Any

from patchkit.plan import Manifest

FAILING = ("drifted: signature", "drifted: body", "moved", "missing")

_lock = threading.Lock()
_cache: dict[tuple[str, str], list[Verdict]] = {}


@dataclass(frozen=True)
class Verdict:
    """One requirement against the running vLLM.

    ``verdict`` is ``ok``, ``drifted: signature``, ``drifted: body``, ``moved``,
    ``missing`` or ``unreadable: …``; ``fails`` is True when it is not ``ok`` and
    the requirement's ``on_drift`` is ``fail`` (``warn``/``skip``: reported only).
    ``feature``: the requirement's feature (None: the plugin as a whole).
    """

    target: str
    pin: str
    verdict: str
    on_drift: str
    why: str
    pinned: str | None
    found: str | None
    where: str | None
    feature: str | None = None

    @property
    def fails(self) -> bool:
        return self.verdict != "ok" and self.on_drift == "fail"

    def describe(self) -> str:
        """``target: verdict (pin P; pinned X, found Y)`` for messages."""
        return (f"{self.target}: {self.verdict} (pin {self.pin}; pinned {self.pinned or '-'}, "
                f"found {self.found or '-'})")


def verdicts(manifest: Manifest, source: str = "installed") -> list[Verdict]:
    """Judge every requirement of ``manifest`` against ``source`` (``installed``, a folder or a wheel)."""
    from patchkit.static import Resolver, TreeError, analyze, open_tree

    if not manifest.requires:
        return []
    collecting = gc.isenabled()
    gc.disable()  # parsing builds large acyclic trees (see patchkit.review.check)
    try:
        try:
            resolver = Resolver(open_tree(source))
        except TreeError as exc:
            return [Verdict(r.target, r.pin, f"unreadable: {exc}", r.on_drift, r.why, r.fingerprint, None, None,
                            r.feature) for r in manifest.requires]
        out = []
        for r in manifest.requires:
            try:
                report = analyze(resolver, r, manifest.packages)
                verdict = report.verdict
            except RecursionError:
                verdict, report = "unreadable: a source file nests too deeply", None
            d = report.definition if report else None
            where = f"{resolver.tree.path_of(d.module)}:{d.first_line}" if d else None
            out.append(Verdict(r.target, r.pin, verdict, r.on_drift, r.why, r.fingerprint,
                               report.found if report else None, where, r.feature))
        return out
    finally:
        if collecting:
            gc.enable()


def refusing(results: list[Verdict], feature: str | None = None) -> list[Verdict]:
    """The failing verdicts (``fails``) that refuse ``feature``; ``None``: those of requirements without a
    feature, which refuse the plugin itself. A requirement of another feature never refuses this one."""
    return [v for v in results if v.fails and v.feature == feature]


def of_status(status: Any) -> list[Verdict]:
    """The verdicts for a ``patchkit.Status`` (its selected manifest), computed once per manifest."""
    run = status.run
    if run is None:
        return []
    planned: Manifest = run.manifest
    key = (status.plugin, planned.digest)
    with _lock:
        if key not in _cache:
            _cache[key] = verdicts(_with_requirements(planned))
            _log(status.plugin, _cache[key])
        return _cache[key]


def _log(plugin: str, results: list[Verdict]) -> None:
    import logging

    log = logging.getLogger("patchkit")
    for v in results:
        if v.verdict != "ok":
            level = logging.ERROR if v.fails and v.feature is None else logging.WARNING
            scope = f" (feature {v.feature})" if v.feature else ""
            log.log(level, "patchkit: %s: requirement%s %s", plugin, scope, v.describe())


def _with_requirements(planned: Manifest) -> Manifest:
    """The selected manifest as loaded from its file (a cached plan carries no ``requires``).

    A file edited since the plan was made is still judged, with a warning: its requirements are the
    ones a restarted process would apply."""
    import logging

    from patchkit import manifest
    from patchkit.plan import ManifestError

    log = logging.getLogger("patchkit")
    try:
        loaded = manifest.load(planned.file)
    except (ManifestError, OSError) as exc:
        log.error("patchkit: requirements of %s cannot be judged: %s", planned.file, exc)
        return planned
    if loaded.digest != planned.digest:
        log.warning("patchkit: %s changed since this process planned from it; judging its current requirements",
                    planned.file)
    return loaded
