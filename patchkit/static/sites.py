"""Every place in a tree that binds a module-level target under its own name.

Patching ``m.f`` replaces one attribute. Code elsewhere sees the patch or not
depending on *how* it reached ``f``:

=================  ===================================================  ==========================
kind               example                                              sees the patch when
=================  ===================================================  ==========================
from-import        module level ``from m import f``                     the module is in the
                                                                        entry's rebind scope and
                                                                        binds the name ``f``
                                                                        (``rebind`` matches names)
star-import        module level ``from m import *``                     same as from-import
function-local     ``def g(): from m import f`` (re-read at each call)  the module it reads from
                                                                        holds the patched object
module-alias       ``import m as mm`` / ``from pkg import m`` then      same (attribute read at
                   ``mm.f``                                             call time)
class-level        ``class C: from m import f``                         never (not rebound)
type-checking      under ``if TYPE_CHECKING:``                          always (never executed)
=================  ===================================================  ==========================

Re-exports are followed: a module-level ``from m import f`` in a package
``__init__`` makes that package a *holder* too, and sites importing from it are
listed with their coverage derived from the holder's.

Speed: only files whose bytes contain a holder's bound name (or ``import *``)
are parsed; the search repeats while new holders appear. Limits: ``getattr(m,
"f")``, ``importlib.import_module`` and plain ``import m`` (no ``as``) are not
listed — they read the attribute at call time and so see the patch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from patchkit.static.resolve import Resolver


@dataclass(frozen=True)
class AliasSite:
    """One statement that binds the target (or the module holding it) in another module."""

    module: str
    file: str
    line: int
    kind: str  # from-import | star-import | function-local | module-alias | class-level | type-checking
    bound: str  # the local name it binds
    source: str  # the module it imports from
    covered: bool  # whether code using this binding sees the patched object
    note: str

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


_Add = Callable[[str, str, str, bool, str], None]  # kind, bound, source, covered, note


@dataclass
class _Holder:
    name: str  # the name the object has in that module
    covered: bool


_Imports = list[tuple[ast.Import | ast.ImportFrom, str]]
_IMPORT_START = re.compile(rb"(?m)^([ \t]*)(?:from[ \t]+[\w.]+[ \t]+import\b|import[ \t]+[\w.])")
_TYPE_CHECKING_IF = re.compile(rb"(?:el)?if[ \t(]+(?:typing\.)?TYPE_CHECKING[ \t)]*:")
_TRIPLE = re.compile(b'"""' + b"|" + b"'" * 3)
_HEADERS = frozenset((b"def", b"async", b"class", b"if", b"elif", b"else", b"try", b"except", b"finally",
                      b"with", b"for", b"while", b"match", b"case"))
_WORD = re.compile(rb"[A-Za-z_]+")


def _statement_end(data: bytes, pos: int) -> int:
    """End offset of the import statement whose keyword ends at ``pos`` (parentheses, backslashes)."""
    line_end = data.find(b"\n", pos)
    line_end = len(data) if line_end < 0 else line_end
    paren = data.find(b"(", pos, line_end)
    hash_at = data.find(b"#", pos, line_end)
    if paren >= 0 and (hash_at < 0 or paren < hash_at):
        close = data.find(b")", paren)
        if close < 0:
            return len(data)
        line_end = data.find(b"\n", close)
        return len(data) if line_end < 0 else line_end
    while line_end < len(data) and data[line_end - 1:line_end] == b"\\":
        nxt = data.find(b"\n", line_end + 1)
        line_end = len(data) if nxt < 0 else nxt
    return line_end


def _context(lines: list[bytes], index: int, indent: int) -> str:
    """Context of a statement at ``lines[index]`` from the headers that enclose it (by indentation)."""
    bound = indent
    in_class = False
    type_checking = False
    j = index - 1
    while bound > 0 and j >= 0:
        line = lines[j]
        j -= 1
        stripped = line.lstrip()
        if not stripped or stripped.startswith(b"#"):
            continue
        level = len(line) - len(stripped)
        if level >= bound:
            continue
        word = _WORD.match(stripped)
        keyword = word.group(0) if word else b""
        if keyword not in _HEADERS:
            bound = level + 1  # a continuation line (``) -> T:``): its header is at this level or less
            continue
        if keyword in (b"def", b"async"):
            return "function"
        if keyword == b"class":
            in_class = True
        elif _TYPE_CHECKING_IF.match(stripped):
            type_checking = True
        bound = level
    if in_class:
        return "class"
    return "type-checking" if type_checking else "module"


def _string_spans(data: bytes) -> list[tuple[int, int]]:
    """Spans of triple-quoted strings (docstrings), paired in order; quotes inside comments confuse it."""
    spans = []
    pos = 0
    while True:
        opening = _TRIPLE.search(data, pos)
        if opening is None:
            return spans
        close = data.find(opening.group(0), opening.end())
        if close < 0:
            spans.append((opening.start(), len(data)))
            return spans
        spans.append((opening.start(), close + 3))
        pos = close + 3


@dataclass
class _RawImport:
    """One import statement located by text; parsed (and placed) only when asked."""

    start: int
    end: int
    indent: int
    parsed: _Imports | None = None


def _raw_imports(data: bytes) -> list[_RawImport]:
    out = []
    spans: list[tuple[int, int]] | None = None
    for match in _IMPORT_START.finditer(data):
        start = match.start()
        if spans is None:
            spans = _string_spans(data) if _TRIPLE.search(data) else []
        if any(a < start < b for a, b in spans):
            continue
        indent = len(match.group(1))
        out.append(_RawImport(start, _statement_end(data, match.end()), indent))
    return out


def _parse_raw(data: bytes, raw: _RawImport, lines: list[bytes]) -> _Imports:
    if raw.parsed is None:
        raw.parsed = []
        for _ in range(8):  # a ')' inside a comment ends the statement too early: extend and retry
            try:
                tree = ast.parse(data[raw.start + raw.indent:raw.end])
                break
            except (SyntaxError, ValueError):
                close = data.find(b")", raw.end)
                if b"(" not in data[raw.start:raw.end] or close < 0:
                    return raw.parsed
                line_end = data.find(b"\n", close)
                raw.end = len(data) if line_end < 0 else line_end
        else:
            return raw.parsed
        line = data.count(b"\n", 0, raw.start) + 1
        context = _context(lines, line - 1, raw.indent) if raw.indent else "module"
        for stmt in tree.body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                ast.increment_lineno(stmt, line - 1)
                raw.parsed.append((stmt, context))
    return raw.parsed


class ImportIndex:
    """Per-tree cache: which files contain a word, and their import statements (parsed on demand).

    A file's import statements are found without parsing the file: each is located by a
    regular expression, parsed alone, and placed by the indentation of the headers above it
    (``def`` → function, ``class`` → class, ``if TYPE_CHECKING`` → type-checking); imports
    inside triple-quoted strings are skipped. The tests compare this with a walk of the full
    parse on synthetic edge cases and on real vLLM files (``tests/support/import_scan.py``).
    """

    def __init__(self, resolver: Resolver) -> None:
        self.tree = resolver.tree
        self._containing: dict[bytes, list[str]] = {}
        self._raw: dict[str, list[_RawImport]] = {}
        self._lines: dict[str, list[bytes]] = {}

    @classmethod
    def of(cls, resolver: Resolver) -> ImportIndex:
        index = resolver.extras.get("imports")
        if index is None:
            index = resolver.extras["imports"] = cls(resolver)
        return index  # type: ignore[no-any-return]

    def containing(self, needle: bytes) -> list[str]:
        """Modules whose bytes contain ``needle`` (one scan of the tree per needle, then cached)."""
        found = self._containing.get(needle)
        if found is None:
            found = self._containing[needle] = [m for m, data in self.tree.all_data() if needle in data]
        return found

    def statements(self, module: str, tokens: Iterable[bytes]) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        """The module's import statements whose text contains one of ``tokens``, parsed, with context."""
        data = self.tree.data(module)
        raws = self._raw.get(module)
        if raws is None:
            raws = self._raw[module] = _raw_imports(data)
        tokens = tuple(tokens)
        for raw in raws:
            chunk = data[raw.start:raw.end]
            if any(t in chunk for t in tokens):
                lines = self._lines.get(module)
                if lines is None:
                    lines = self._lines[module] = data.split(b"\n")
                yield from _parse_raw(data, raw, lines)


def in_scope(module: str, prefixes: Iterable[str]) -> bool:
    """Whether ``rebind`` with these module-name prefixes reaches ``module``."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def alias_sites(resolver: Resolver, entry_module: str, name: str, defining: tuple[str, str] | None,
                prefixes: tuple[str, ...], rebinds: bool) -> list[AliasSite]:
    """Sites binding the module-level target ``entry_module:name`` (see the module docstring).

    ``defining`` is (module, name) of the definition when the target is a re-export;
    ``prefixes`` is the entry's rebind scope; ``rebinds`` is False for ops that never rebind
    (``set``), which leaves every module-level copy stale.
    """
    holders: dict[str, _Holder] = {entry_module: _Holder(name, True)}
    if defining is not None and defining[0] != entry_module:
        covered = rebinds and defining[1] == name and in_scope(defining[0], prefixes)
        holders[defining[0]] = _Holder(defining[1], covered)
    index = ImportIndex.of(resolver)
    candidates: set[str] = set(index.containing(b"import *"))
    searched: set[bytes] = set()
    sites: dict[tuple[str, int, str, str], AliasSite] = {}
    while True:
        needles = {h.name.encode() for h in holders.values()} - searched
        for needle in needles:
            candidates.update(index.containing(needle))
        searched |= needles
        tokens = searched | {m.rpartition(".")[2].encode() for m in holders} | {b"*"}
        before = len(holders)
        for module in sorted(candidates):
            for stmt, context in index.statements(module, tokens):
                for site in _evaluate(resolver, module, stmt, context, holders, name, prefixes, rebinds):
                    sites[(site.module, site.line, site.bound, site.source)] = site
                    if site.kind in ("from-import", "star-import") and site.module not in holders:
                        holders[site.module] = _Holder(site.bound, site.covered)
        if len(holders) == before:
            break
    return sorted(sites.values(), key=lambda s: (s.module, s.line, s.bound))


def _evaluate(resolver: Resolver, module: str, stmt: ast.Import | ast.ImportFrom, context: str,
              holders: dict[str, _Holder], name: str, prefixes: tuple[str, ...],
              rebinds: bool) -> list[AliasSite]:
    tree = resolver.tree
    out: list[AliasSite] = []
    if module in holders and module == next(iter(holders)):
        return out  # the target's own module

    def site(kind: str, bound: str, source: str, covered: bool, note: str) -> None:
        out.append(AliasSite(module, tree.modules[module], stmt.lineno, kind, bound, source, covered, note))

    if isinstance(stmt, ast.ImportFrom):
        source = resolver.absolute(module, stmt.level, stmt.module)
        if source is None:
            return out
        holder = holders.get(source)
        for alias in stmt.names:
            if holder is not None and alias.name in (holder.name, "*"):
                if alias.name == "*" and holder.name.startswith("_"):
                    continue
                bound = alias.asname or alias.name if alias.name != "*" else holder.name
                kind = "star-import" if alias.name == "*" else "from-import"
                _binding_site(site, kind, context, module, bound, source, holder, name, prefixes, rebinds)
            elif f"{source}.{alias.name}" in holders:
                target_holder = holders[f"{source}.{alias.name}"]
                _module_alias(site, context, alias.asname or alias.name, f"{source}.{alias.name}", target_holder)
    else:
        for alias in stmt.names:
            if alias.asname and alias.name in holders:
                _module_alias(site, context, alias.asname, alias.name, holders[alias.name])
    return out


def _binding_site(add: _Add, kind: str, context: str, module: str, bound: str, source: str,
                  holder: _Holder, name: str, prefixes: tuple[str, ...], rebinds: bool) -> None:
    if context == "type-checking":
        add("type-checking", bound, source, True, "under TYPE_CHECKING: never executed")
    elif context == "function":
        note = (f"function-local: re-reads {source}.{holder.name} at call time"
                + ("" if holder.covered else f", which is not rebound ({source} keeps the original)"))
        add("function-local", bound, source, holder.covered, note)
    elif context == "class":
        add("class-level", bound, source, False, "class attribute copy: rebind does not reach it")
    elif not rebinds:
        add(kind, bound, source, False, "module-level copy; this op never rebinds")
    elif bound != name:
        add(kind, bound, source, False,
            f"module-level copy under another name ({bound!r}): rebind matches the name {name!r} only")
    elif not in_scope(module, prefixes):
        scope = ", ".join(prefixes) if prefixes else "none"
        add(kind, bound, source, False, f"module-level copy outside the rebind scope ({scope})")
    else:
        add(kind, bound, source, True, "module-level copy inside the rebind scope: rebound")


def _module_alias(add: _Add, context: str, bound: str, source: str, holder: _Holder) -> None:
    note = f"module alias: reads {source}.{holder.name} at call time"
    if not holder.covered:
        note += f", which is not rebound ({source} keeps the original)"
    add("module-alias", bound, source, holder.covered or context == "type-checking", note)
