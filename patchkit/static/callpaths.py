"""Call paths: callers that choose between a patched target and a same-named object of another module.

A patch replaces one object. A caller that binds the same local name to one of two objects, depending on
a condition, reaches the patch on one path only::

    if current_platform.uses_standalone_cpu_model_runner():
        from vllm.v1.worker.cpu.warmup import warmup_kernels     # the sibling
    else:
        from vllm.v1.worker.gpu.warmup import warmup_kernels     # the patched target
    warmup_kernels(...)

``call_paths(resolver, target)`` finds, for a ``module:qualname`` target, every such choice in the tree
and returns one ``CallPath`` per (choice, sibling). The forms recognised (``kind``):

- ``if-branch`` — imports of one name in different arms of one ``if``/``elif``/``else`` chain
  (in a module body or in a function); ``condition`` is the boolean, in the source's words, under which the
  target's arm runs (``not (A) and B`` for the ``elif B`` arm of ``if A``); also an import under an ``if``
  that rebinds a name imported before it in the enclosing block (``when A`` / ``not (A)``);
- ``try-except`` — one import in a ``try`` body (or its ``else``), another in an ``except`` handler;
  the condition names the handler (``except ImportError``);
- ``global-vs-local`` — a module-level import of a name and a function-local import of the same name
  from elsewhere: that function sees the local one (``condition``: ``inside F`` / ``outside F``).

Each form counts for names (``from m import f``, ``via: from-import``) and for module aliases
(``import a.b as m`` / ``from a import b as m`` chosen by a condition, then ``m.f``, ``via:
module-alias``). For a class member target (``m:C.meth``) the choice is of the class ``C`` and the
sibling is the other class's member of the same name. ``sibling`` is where the other object is defined
(``module:qualname``, re-exports followed), or the name as imported when it is outside the tree.
Whether a manifest entry patches the sibling is decided by the caller (``patchkit check``), which knows
every entry.

Speed (``patchkit.static.choices``): only modules with an indented import statement naming the target's
first name or its module are looked at (one text index of such statements per tree), then, through the
tree's shared ``ImportIndex`` (import statements located by text and parsed alone), a module is parsed
whole only when two of its import statements bind the same local name, one of them the target (or its
module). Each first name is collected once per tree. On the 0.34 wheel the 27 patch entries of
vllm-0.34.yaml cost about 0.18 s of CPU together, about 0.09 s of it building the index.

Limits (stated so a reader can judge an empty answer): the choice must be made by import statements;
choices made by values are not seen — a registry or dict lookup, ``getattr(m, name)`` with a computed
name, ``importlib.import_module(...)``, ``f = a.f if c else b.f``, an object passed in by the caller, or a
plugin that decides at run time. Two functions that each import a different object are not a choice (each
always uses its own); ``match`` arms and loops are read as straight-line code; a sibling that merely
inherits the member is reported at the class that would have defined it; imports indented with tabs, a
choice whose imports all rename the target (``from a import f as g`` in every arm) and one whose only
indented import names neither the target nor its module are missed by the text index.
"""

from __future__ import annotations

from dataclasses import dataclass

from patchkit.static.choices import Bind, Collector, IndentedImports, Text, candidates, names_bound_twice
from patchkit.static.resolve import Definition, ModuleRef, Resolver
from patchkit.static.sites import ImportIndex


@dataclass(frozen=True)
class CallPath:
    """One caller's choice between the patched target and a sibling."""

    caller: str  # module:qualname of the function that chooses, or the module
    file: str
    line: int  # the ``if``/``try`` that chooses, or the function-local import
    kind: str  # if-branch | try-except | global-vs-local
    via: str  # from-import | module-alias
    condition: str  # when the target is chosen, in the source's words
    sibling_condition: str  # when the sibling is chosen
    chosen: str  # the target as the entry names it
    sibling: str  # module:qualname of the other object

    def to_json(self, patched: bool = False) -> dict[str, object]:
        return {**self.__dict__, "sibling_patched": patched}


def _key(found: Definition | ModuleRef | None) -> tuple[str, str] | None:
    if isinstance(found, Definition):
        return found.module, found.qualname
    return (found.module, "") if isinstance(found, ModuleRef) else None


class _Target:
    """What a binding must name to be the target: its first name's definition, or a module holding it."""

    def __init__(self, resolver: Resolver, target: str) -> None:
        self.resolver = resolver
        self.ref = target
        module, _, qualname = target.partition(":")
        self.head, *self.rest = qualname.split(".")
        found = resolver.resolve(module, [self.head])
        self.key = _key(found) if isinstance(found, Definition) else None
        self.modules = {module, *([found.module] if isinstance(found, Definition) else [])}

    def chosen(self, bind: Bind) -> bool:
        if isinstance(bind.found, ModuleRef):
            return _key(self.resolver.resolve(bind.found.module, [self.head])) == self.key
        return _key(bind.found) == self.key

    def sibling(self, bind: Bind) -> str | None:
        """Where the object the other binding names is defined (None: the same object as the target)."""
        if bind.via == "module-alias" and not isinstance(bind.found, Definition):
            module = bind.found.module if isinstance(bind.found, ModuleRef) else bind.written
            found = self.resolver.resolve(module, [self.head]) if isinstance(bind.found, ModuleRef) else None
            written = f"{module}:{self.head}"
        else:
            found, written = bind.found, bind.written
        if _key(found) == self.key:
            return None
        rest = ".".join(self.rest)
        if isinstance(found, Definition):
            member = self.resolver.descend(found, self.rest) if self.rest else found
            return member.ref if isinstance(member, Definition) else f"{found.ref}.{rest}" if rest else found.ref
        return f"{written}.{rest}" if rest else written


def _pair(target: _Target, mine: Bind, other: Bind, module: str, file: str, text: Text) -> CallPath | None:
    """The choice between two bindings of one name, when they are alternatives (None when not)."""
    sibling = target.sibling(other)
    if sibling is None:
        return None
    if mine.scope == other.scope:
        caller = f"{module}:{mine.scope}" if mine.scope else module
        for a, b in zip(mine.arms, other.arms, strict=False):
            if a == b:
                continue
            if a.chain != b.chain:
                return None
            return CallPath(caller, file, a.line, a.kind, mine.via, a.condition(text), b.condition(text), target.ref,
                            sibling)
        shared = min(len(mine.arms), len(other.arms))
        inner, outer = (mine, other) if len(mine.arms) > shared else (other, mine)
        if len(inner.arms) == shared or inner.line < outer.line:
            return None  # one after the other in the same arm, or an import the one after it always replaces
        when = " and ".join(a.condition(text) for a in inner.arms[shared:])  # the later, deeper one rebinds
        first = inner.arms[shared]
        conditions = (when, f"not ({when})") if inner is mine else (f"not ({when})", when)
        return CallPath(caller, file, first.line, first.kind, mine.via, *conditions, target.ref, sibling)
    if "" not in (mine.scope, other.scope):
        return None  # two functions, each with its own import: no choice
    local = mine if mine.scope else other
    inside = f"inside {local.scope}" + "".join(f" when {a.condition(text)}" for a in local.arms)
    outside = f"outside {local.scope}"
    return CallPath(f"{module}:{local.scope}", file, local.line, "global-vs-local", mine.via,
                    inside if local is mine else outside, outside if local is mine else inside, target.ref, sibling)


def _collectors(resolver: Resolver, wanted: _Target) -> list[Collector]:
    """The modules that may choose ``wanted``'s first name, collected (once per tree and name)."""
    cache: dict[object, list[Collector]] = resolver.extras.setdefault("callpaths", {})  # type: ignore[assignment]
    key = (wanted.key, tuple(sorted(wanted.modules)))
    found = cache.get(key)
    if found is None:
        found = cache[key] = []
        indented = resolver.extras.get("indented-imports")
        if not isinstance(indented, IndentedImports):
            indented = resolver.extras["indented-imports"] = IndentedImports(resolver)
        index = ImportIndex.of(resolver)
        tokens = {m.rpartition(".")[2] for m in wanted.modules}
        for module in candidates(indented, index, wanted.head, tokens):
            names = names_bound_twice(index, module, wanted.head, tokens)
            if names:
                collector = Collector(resolver, module, names)
                collector.body(resolver.tree.parse(module).body, "", ())
                found.append(collector)
    return found


def call_paths(resolver: Resolver, target: str) -> list[CallPath]:
    """Every choice in the tree between ``target`` (``module:qualname``) and a same-named sibling."""
    wanted = _Target(resolver, target)
    if wanted.key is None:
        return []
    found: dict[tuple[str, int, str], CallPath] = {}
    for collector in _collectors(resolver, wanted):
        module = collector.module
        file = resolver.tree.modules[module]
        for mine in collector.binds:
            if not wanted.chosen(mine):
                continue
            for other in collector.binds:
                if other.name == mine.name and other is not mine:
                    path = _pair(wanted, mine, other, module, file, collector.text)
                    if path is not None:
                        found.setdefault((path.caller, path.line, path.sibling), path)
    return sorted(found.values(), key=lambda p: (p.file, p.line, p.sibling))
