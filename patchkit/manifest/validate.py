"""Manifest files → validated, immutable ``Manifest`` objects.

Reading a manifest is three checks, each naming file, line and field:
1. safe YAML (``yamlsrc``): only plain data, no duplicate keys; a file that ``extends``
   another is merged with it first (``patchkit.manifest.inherit``), and every later
   problem names the file and line its value came from;
2. the JSON Schema ``manifest.schema.json`` on the resolved document: shapes, types, no unknown keys;
3. semantics (``_semantic_problems``): unique ids, known ``after`` ids, no cycles,
   no two unordered writers of one attribute, the fields each op needs (``scoped-rebind``:
   ``bind`` and ``active_if``, no ``with``/``value``), and every callable inside the
   packages the manifest declares.

A file that fails any check yields a ``ManifestError`` listing every problem; no
object is imported while reading, so a bad manifest patches nothing.

This module imports ``yaml`` and ``jsonschema``; the runtime hot path avoids it
by reading a compiled plan from ``patchkit.runtime.cache``.
"""

from __future__ import annotations

import itertools
import json
import pathlib
from functools import cache
from typing import Any

from patchkit.manifest.inherit import MAX_FILE_BYTES, Resolved, read_bytes, resolve
from patchkit.manifest.problems import FieldPath, Problem, field_name
from patchkit.plan import (
    WORKERS_ENTRY_ID,
    Change,
    Manifest,
    ManifestError,
    ModelRegistration,
    Patch,
    Requirement,
    ScopedRebind,
    WorkerOverride,
)
from patchkit.runtime.cache import schema_path


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every local ``$ref`` (``#/$defs/NAME``) replaced by what it names: the same
    constraints, without a reference lookup per validated value (the schema has no recursion)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = _inline(defs[ref.removeprefix("#/$defs/")], defs)
            rest = {k: _inline(v, defs) for k, v in node.items() if k != "$ref"}
            return {**rest, "allOf": [target]} if rest else target
        return {k: v if k == "$defs" else _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


@cache
def _validator() -> Any:
    import jsonschema

    schema = json.loads(pathlib.Path(schema_path("manifest.schema.json")).read_text())
    return jsonschema.Draft202012Validator(_inline(schema, schema.get("$defs", {})))


def _at(res: Resolved, path: FieldPath) -> tuple[str, int]:
    """File and line a value came from (its nearest located ancestor's)."""
    return res.at(path)


def _source(res: Resolved, path: FieldPath) -> str:
    return "{}:{}".format(*res.at(path))


def _schema_problems(doc: Any, lines: Resolved) -> list[Problem]:
    problems = []
    for error in _validator().iter_errors(doc):
        path: FieldPath = tuple(error.absolute_path)
        message = error.message
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = set(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - allowed):
                problems.append(
                    Problem(*_at(lines, (*path, key)), field_name((*path, key)),
                            f"unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")
                )
            continue
        if error.validator == "required":
            message = message.replace("is a required property", "is required")
        elif len(message) > 200:
            message = message[:200] + "…"
        problems.append(Problem(*_at(lines, path), field_name(path), message))
    return sorted(problems, key=lambda p: (p.file, p.line, p.field))


def _ref_package(ref: str) -> str:
    return ref.partition(":")[0].split(".")[0]


def _semantic_problems(doc: dict[str, Any], lines: Resolved) -> list[Problem]:
    problems: list[Problem] = []

    def add(path: FieldPath, message: str) -> None:
        problems.append(Problem(*_at(lines, path), field_name(path), message))

    packages = set(doc["packages"])

    def check_ref(path: FieldPath, ref: str) -> None:
        if _ref_package(ref) not in packages:
            add(path, f"{ref!r} is outside the declared packages ({', '.join(sorted(packages))})")

    patches = doc.get("patches", [])
    ids: dict[str, int] = {}
    for i, p in enumerate(patches):
        if p["id"] in ids or (p["id"] == WORKERS_ENTRY_ID and "workers" in doc):
            add(("patches", i, "id"), f"duplicate id {p['id']!r}")
        ids.setdefault(p["id"], i)
        op = p["op"]
        if op in ("replace", "wrap") and "with" not in p:
            add(("patches", i), f"op {op!r} needs 'with'")
        if op in ("replace", "wrap") and "value" in p:
            add(("patches", i, "value"), f"op {op!r} takes no 'value'")
        if op == "set" and ("with" in p) == ("value" in p):
            add(("patches", i), "op 'set' needs exactly one of 'value' and 'with'")
        if op == "scoped-rebind":
            for key in ("with", "value"):
                if key in p:
                    add(("patches", i, key), f"op 'scoped-rebind' takes no {key!r}")
            for key in ("bind", "active_if"):
                if key not in p:
                    add(("patches", i), f"op 'scoped-rebind' needs {key!r}")
            for name, ref in p.get("bind", {}).items():
                check_ref(("patches", i, "bind", name), ref)
            if "active_if" in p:
                check_ref(("patches", i, "active_if"), p["active_if"])
        else:
            for key in ("module", "bind", "active_if"):
                if key in p:
                    add(("patches", i, key), f"{key!r} is for op 'scoped-rebind' only")
        if "with" in p:
            check_ref(("patches", i, "with"), p["with"])
    workers = doc.get("workers")
    if workers:
        ids[WORKERS_ENTRY_ID] = len(patches)
        check_ref(("workers", "role_of"), workers["role_of"])
        for j, o in enumerate(workers["overrides"]):
            check_ref(("workers", "overrides", j, "class"), o["class"])
    _requirement_problems(doc, add)
    _feature_problems(doc, add)
    archs: set[str] = set()
    for k, m in enumerate(doc.get("models", [])):
        check_ref(("models", k, "class"), m["class"])
        if m["arch"] in archs:
            add(("models", k, "arch"), f"duplicate arch {m['arch']!r}")
        archs.add(m["arch"])

    graph: dict[str, list[str]] = {}
    for i, p in enumerate(patches):
        graph[p["id"]] = [a for a in p.get("after", []) if a != p["id"]]
        for a in p.get("after", []):
            if a not in ids:
                add(("patches", i, "after"), f"unknown id {a!r}")
            elif a == p["id"]:
                add(("patches", i, "after"), "an entry cannot come after itself")
    if workers:
        graph[WORKERS_ENTRY_ID] = list(workers.get("after", []))
        for a in graph[WORKERS_ENTRY_ID]:
            if a not in ids:
                add(("workers", "after"), f"unknown id {a!r}")
    cycle = _find_cycle(graph)
    if cycle:
        first = cycle[0]
        path = ("workers", "after") if first == WORKERS_ENTRY_ID else ("patches", ids[first], "after")
        add(path, "order cycle: " + " -> ".join(cycle))
    elif not problems:
        _conflict_problems(doc, graph, add)
    return problems


def _requirement_problems(doc: dict[str, Any], add: Any) -> None:
    """Requirements: one per target, and a fingerprint wherever the pin compares one."""
    seen: dict[str, int] = {}
    for i, r in enumerate(doc.get("requires", [])):
        if r["target"] in seen:
            add(("requires", i, "target"),
                f"duplicate requirement {r['target']!r} (first at requires[{seen[r['target']]}])")
        seen.setdefault(r["target"], i)
        if r["pin"] != "exists" and "fingerprint" not in r:
            add(("requires", i), f"pin {r['pin']!r} needs a 'fingerprint' (patchkit deps --tree SRC prints it)")


def _feature_problems(doc: dict[str, Any], add: Any) -> None:
    """Every ``feature`` a member names is declared in the top-level ``features`` (through ``extends``)."""
    declared = set(doc.get("features", {}))
    members: list[tuple[FieldPath, dict[str, Any]]] = [
        *((("patches", i), p) for i, p in enumerate(doc.get("patches", []))),
        *((("requires", i), r) for i, r in enumerate(doc.get("requires", []))),
        *((("models", k), m) for k, m in enumerate(doc.get("models", []))),
    ]
    if doc.get("workers"):
        members.append((("workers",), doc["workers"]))
    for path, item in members:
        name = item.get("feature")
        if name is not None and name not in declared:
            add((*path, "feature"), f"undeclared feature {name!r} (declare it under 'features:' with its "
                                    f"'without' words; declared: {', '.join(sorted(declared)) or 'none'})")


def _find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return None


def _comes_after(graph: dict[str, list[str]], later: str, earlier: str) -> bool:
    """Whether ``earlier`` is reachable from ``later`` over ``after`` edges."""
    seen: set[str] = set()
    todo = list(graph.get(later, []))
    while todo:
        n = todo.pop()
        if n == earlier:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(graph.get(n, []))
    return False


def _topological_positions(graph: dict[str, list[str]]) -> dict[str, int]:
    """Each id's position in the plan order (``after`` first, file order as the tie-break); acyclic graph."""
    position: dict[str, int] = {}

    def place(node: str) -> None:
        todo = [(node, iter(graph.get(node, [])))]
        while todo:
            current, deps = todo[-1]
            dep = next((d for d in deps if d in graph and d not in position), None)
            if dep is None:
                todo.pop()
                position.setdefault(current, len(position))
            else:
                todo.append((dep, iter(graph.get(dep, []))))

    for node in graph:
        place(node)
    return position


def _conflict_problems(doc: dict[str, Any], graph: dict[str, list[str]], add: Any) -> None:
    """Writers of one attribute must be ordered, and only the first may replace or set it.

    The writers of one target, sorted by plan position, must form a chain in which
    each comes ``after`` the previous one (then all are ordered, by transitivity); so
    only neighbours are compared, which keeps a file with many writers of one target
    linear in its problems (each neighbour pair is reported at most once)."""
    writers: dict[str, list[tuple[str, str, FieldPath]]] = {}
    for i, p in enumerate(doc.get("patches", [])):
        writers.setdefault(p["target"], []).append((p["id"], p["op"], ("patches", i, "target")))
    if doc.get("workers"):
        writers.setdefault(doc["workers"]["at"], []).append((WORKERS_ENTRY_ID, "wrap", ("workers", "at")))
    shared = {t: ws for t, ws in writers.items() if len(ws) > 1}
    if not shared:
        return
    position = _topological_positions(graph)
    for target, ws in shared.items():
        ws.sort(key=lambda w: position.get(w[0], 0))
        for (ida, opa, _), (idb, opb, pathb) in itertools.pairwise(ws):
            if not _comes_after(graph, idb, ida):
                add(pathb, f"{idb!r} and {ida!r} both write {target} with no order between them"
                          " (add one to the other's 'after')")
            elif opb not in ("wrap", "scoped-rebind"):  # b comes after a and does not delegate to it
                add(pathb, f"{idb!r} ({opb}) comes after {ida!r} ({opa}) on {target} and would discard it")


def _change(p: dict[str, Any], defaults: dict[str, Any], source: str) -> Change:
    """The typed entry of one ``patches[]`` item (validated)."""
    rebind = p.get("rebind", defaults.get("rebind", "auto"))
    common: dict[str, Any] = {
        "id": p["id"], "target": p["target"], "source": source, "fingerprint": p.get("fingerprint"),
        "reviewed": p.get("reviewed"),
        "after": tuple(p.get("after", [])), "when": p.get("when", {}),
        "rebind": tuple(rebind) if isinstance(rebind, list) else rebind,
        "on_drift": p.get("on_drift", defaults.get("on_drift", "fail")),
        "required": p.get("required", defaults.get("required", True)),
        "why": p["why"], "upstream": p.get("upstream"), "retire_when": p.get("retire_when", {}),
        "feature": p.get("feature"), "call_paths": p.get("call_paths", "warn"),
    }
    if p["op"] == "scoped-rebind":
        return ScopedRebind(**common, namespace=p.get("module", p["target"].partition(":")[0]),
                            bind=tuple(p["bind"].items()), active_if=p["active_if"])
    return Patch(**common, op=p["op"], with_=p.get("with"), value=p.get("value"), has_value="value" in p)


def _build(doc: dict[str, Any], lines: Resolved, file: str) -> Manifest:
    defaults = doc.get("defaults", {})
    entries: list[Change] = [_change(p, defaults, _source(lines, ("patches", i)))
                             for i, p in enumerate(doc.get("patches", []))]
    workers = doc.get("workers")
    if workers:
        entries.append(WorkerOverride(
            id=WORKERS_ENTRY_ID, target=workers["at"], source=_source(lines, ("workers",)),
            fingerprint=workers.get("fingerprint"), reviewed=workers.get("reviewed"),
            after=tuple(workers.get("after", [])),
            rebind="none", on_drift=workers.get("on_drift", defaults.get("on_drift", "fail")),
            feature=workers.get("feature"),
            why="select role-specific worker classes when worker_cls is 'auto'",
            role_of=workers["role_of"], overrides=tuple(workers["overrides"]),
        ))
    models = tuple(
        ModelRegistration(arch=m["arch"], class_ref=m["class"], source=_source(lines, ("models", k)),
                          when=m.get("when", {}), feature=m.get("feature"))
        for k, m in enumerate(doc.get("models", []))
    )
    requires = tuple(
        Requirement(id=f"require:{r['target']}", target=r["target"], source=_source(lines, ("requires", i)),
                    fingerprint=r.get("fingerprint"), reviewed=r.get("reviewed"), pin=r["pin"],
                    indirect=r.get("indirect", False),
                    feature=r.get("feature"),
                    on_drift=r.get("on_drift", defaults.get("on_drift", "fail")), why=r["why"])
        for i, r in enumerate(doc.get("requires", []))
    )
    import hashlib

    pin = doc.get("vllm") or {}
    return Manifest(
        file=file, plugin=doc["plugin"], packages=tuple(doc["packages"]),
        vllm_version=pin.get("version"), vllm_commit=pin.get("commit"),
        fallback=doc.get("fallback", False), entries=tuple(entries), models=models,
        digest=hashlib.sha256("|".join(sha for _, sha in lines.chain).encode()).hexdigest(),
        chain=lines.chain, requires=requires,
        features={name: f["without"] for name, f in doc.get("features", {}).items()},
        required_features=tuple(name for name, f in doc.get("features", {}).items() if f.get("required")),
    )


def parse(text: str | bytes, file: str) -> Manifest:
    """Validate one manifest's text completely, with the files it ``extends`` (read from ``file``'s
    folder); raise ManifestError listing every problem, each at the file and line its value came from."""
    # surrogatepass: a str holding lone surrogates becomes bytes that fail UTF-8 decoding in
    # yamlsrc (a ManifestError naming the line), not a UnicodeEncodeError here.
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(raw) > MAX_FILE_BYTES:
        raise ManifestError([Problem(file, 1, "", f"larger than {MAX_FILE_BYTES // 1024} KiB: not read"
                                                  " (a manifest is a few KB)")])
    return build(resolve(raw, file))


def build(res: Resolved) -> Manifest:
    """Validate a resolved document (schema, semantics, specifiers) and build its ``Manifest``."""
    doc = res.doc
    problems = _schema_problems(doc, res)
    if not problems:
        problems = _semantic_problems(doc, res)
        if not problems:
            _check_specifiers(doc, res, problems)
    if problems:
        raise ManifestError(problems)
    return _build(doc, res, res.chain[-1][0])


def _check_specifiers(doc: dict[str, Any], lines: Resolved, problems: list[Problem]) -> None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    def check(path: FieldPath, spec: str) -> None:
        try:
            SpecifierSet(spec)
        except InvalidSpecifier:
            problems.append(Problem(*_at(lines, path), field_name(path),
                                    f"{spec!r} is not a PEP 440 version specifier"))

    if "vllm" in doc:
        check(("vllm", "version"), doc["vllm"]["version"])
    guarded: list[tuple[FieldPath, dict[str, Any]]] = [
        *((("patches", i), p) for i, p in enumerate(doc.get("patches", []))),
        *((("models", k), m) for k, m in enumerate(doc.get("models", []))),
        *((("workers", "overrides", j), o) for j, o in enumerate((doc.get("workers") or {}).get("overrides", []))),
    ]
    for base, item in guarded:
        for key in ("vllm", "python"):
            if key in item.get("when", {}):
                check((*base, "when", key), item["when"][key])
        if "vllm" in item.get("retire_when", {}):
            check((*base, "retire_when", "vllm"), item["retire_when"]["vllm"])


def load(path: str | pathlib.Path) -> Manifest:
    """Read and validate one manifest file and its ``extends`` chain (each refused unread past
    ``MAX_FILE_BYTES``)."""
    path = pathlib.Path(path)
    return build(resolve(read_bytes(path), str(path)))


def resolved(path: str | pathlib.Path) -> Resolved:
    """The resolved document of one manifest file (not validated): for tools that edit or compare it."""
    path = pathlib.Path(path)
    return resolve(read_bytes(path), str(path))


def releases(folder: str | pathlib.Path) -> list[tuple[str, Manifest]]:
    """The releases a manifest folder supports: ``(version, manifest)`` for every manifest pinned to one
    version (``vllm.version == "==X"``), lowest version first; bases and fallbacks are left out.
    Raises ManifestError when a file is invalid. The one place the release list comes from (nox sessions,
    tests, README's table)."""
    from packaging.version import Version

    found = []
    for path in sorted(pathlib.Path(folder).glob("*.yaml")):
        m = load(path)
        if not m.is_base and not m.fallback and m.vllm_version and m.vllm_version.startswith("=="):
            found.append((m.vllm_version[2:], m))
    return sorted(found, key=lambda vm: Version(vm[0]))


ENTRY_POINT_GROUP = "patchkit.manifests"


def registered_manifest_dirs() -> dict[str, pathlib.Path]:
    """Plugin name → manifest folder, from the installed ``patchkit.manifests`` entry points."""
    from importlib.metadata import entry_points

    return {ep.name: pathlib.Path(ep.load()()) for ep in entry_points(group=ENTRY_POINT_GROUP)}
