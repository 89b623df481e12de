"""Selecting and ordering a plan: the part of planning that runs only when the plan cache misses.

Selection: among the valid manifests of a plugin, an exact commit match wins,
then the first (by file name) whose ``vllm.version`` specifier holds, then a
``fallback: true`` manifest. Order: topological over ``after``, file order as
the tie-break. Static guards (vLLM version, commit, Python) are decided here
once (``static_verdict``) and stored in the compiled plan, the worker overrides' too;
``patchkit.plan.runtime_verdict`` decides the guards that can differ between processes.

Kept apart from ``patchkit.plan`` so that the plugin hook, which reads a
cached plan in every vLLM process, loads none of this (nor ``packaging``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from patchkit.plan import (
    Change,
    Compiled,
    Manifest,
    ManifestError,
    Runtime,
    UnsupportedRelease,
    WorkerOverride,
    override_key,
)
from patchkit.verdict import Member, Verdict


def compile_plan(files: list[str] | list[Path], runtime: Runtime) -> Compiled:
    """Validate every manifest (ManifestError on any problem) and select/order for ``runtime``."""
    from patchkit import manifest as manifest_module  # YAML + JSON Schema: only when the cache misses

    manifests = []
    problems = []
    for f in files:
        try:
            manifests.append(manifest_module.load(f))
        except ManifestError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ManifestError(problems)
    try:
        chosen = select(manifests, runtime)
    except UnsupportedRelease as exc:
        return Compiled(None, [], {}, supported(manifests), str(exc), "")
    ordered = order(chosen.entries)
    static = {e.id: static_verdict(e.when, runtime) for e in ordered}
    static.update({f"model:{m.arch}": static_verdict(m.when, runtime) for m in chosen.models})
    for e in ordered:
        if isinstance(e, WorkerOverride):
            static.update({override_key(e.id, i): static_verdict(o.get("when", {}), runtime)
                           for i, o in enumerate(e.overrides)})
    digest = hashlib.sha256(f"{chosen.digest}|{[e.id for e in ordered]}".encode()).hexdigest()[:16]
    verdict = judged(chosen, runtime.tree) if runtime.tree else None
    return Compiled(chosen, [e.id for e in ordered], static, supported(manifests), None, digest, verdict)


def judged(manifest: Manifest, tree_spec: str) -> Verdict:
    """``patchkit.judge.judge`` of ``manifest`` against the tree ``tree_spec`` names. A tree that cannot be read,
    or a judge that fails, gives a verdict that refuses the plugin, naming why (never one that holds unjudged)."""
    from patchkit.judge import judge
    from patchkit.static import TreeError, open_tree

    try:
        return judge(manifest, open_tree(tree_spec))
    except (TreeError, RecursionError, OSError) as exc:
        why = "a source file nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        reason = f"the vLLM tree cannot be read: {why}"
    except Exception as exc:  # noqa: BLE001 - the hook must not raise: refuse, naming the cause
        reason = f"the judge failed on this tree: {exc!r} (a patchkit bug: please report it)"
    unread = Member("vllm-tree", "tree", tree_spec, "unreadable", True, None, reason)
    return Verdict(manifest.file, f"vLLM tree {tree_spec!r}", (unread,), manifest.features)


def select(manifests: list[Manifest], runtime: Runtime) -> Manifest:
    """The manifest for ``runtime``; UnsupportedRelease lists the supported releases otherwise."""
    commit = runtime.vllm_commit or ""
    pinned = sorted((m for m in manifests if not m.fallback and not m.is_base), key=lambda m: m.file)
    for m in pinned:
        if m.vllm_commit and commit and (commit.startswith(m.vllm_commit) or m.vllm_commit.startswith(commit)):
            return m
    for m in pinned:
        if version_in(m.vllm_version, runtime.vllm_version):
            return m
    for m in manifests:
        if m.fallback and not m.is_base:
            return m
    raise UnsupportedRelease(
        f"vLLM {runtime.vllm_version or 'not installed'} (commit {runtime.vllm_commit or 'unknown'}) "
        f"is not supported; supported: {supported(manifests) or 'none'}"
    )


def supported(manifests: list[Manifest]) -> str:
    return ", ".join(f"vllm{m.vllm_version}" for m in sorted(manifests, key=lambda m: m.file)
                     if not m.fallback and not m.is_base)


def order(entries: tuple[Change, ...]) -> list[Change]:
    """Topological order over ``after``; among ready entries, file order first."""
    placed: set[str] = set()
    remaining = list(entries)
    result: list[Change] = []
    while remaining:
        for i, e in enumerate(remaining):
            if all(dep in placed for dep in e.after):
                result.append(remaining.pop(i))
                placed.add(e.id)
                break
        else:  # unreachable for validated manifests (cycles are rejected there)
            raise ValueError("order cycle among: " + ", ".join(e.id for e in remaining))
    return result


def static_verdict(when: dict[str, Any], runtime: Runtime) -> str | None:
    """None when every static guard holds, else the reason the first one fails."""
    if "vllm" in when and not version_in(when["vllm"], runtime.vllm_version):
        return f"vllm {runtime.vllm_version} not in {when['vllm']}"
    if "commit" in when and not any((runtime.vllm_commit or "").startswith(c) for c in when["commit"]):
        return f"vllm commit {runtime.vllm_commit or 'unknown'} not in {when['commit']}"
    if "python" in when and not version_in(when["python"], runtime.python):
        return f"python {runtime.python} not in {when['python']}"
    return None


def version_in(spec: str, version: str | None) -> bool:
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False
