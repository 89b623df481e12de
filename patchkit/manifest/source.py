"""Safe YAML reading that remembers the line of every value.

Only the YAML core types are built (mappings, sequences, strings, numbers,
booleans, null); any other tag (``!!python/object`` and friends) is refused
before anything is constructed. Duplicate keys are errors, not "last one wins".
Anchors are allowed but the expanded document is bounded in size, so a
"billion laughs" file fails fast; the nodes are also counted while the
document is composed, so a long file fails before its whole graph is built.
Events come from libyaml where PyYAML was built with it (fast on large input);
a document libyaml rejects is read again by PyYAML's Python parser, whose
error messages are more precise.

``load(text, file)`` returns ``(document, lines)`` where ``lines`` maps a path
tuple such as ``("patches", 2, "op")`` to its 1-based line number.
"""

from __future__ import annotations

from typing import Any

import yaml

from patchkit.manifest.problems import FieldPath, Problem, field_name
from patchkit.plan import ManifestError

_MAX_NODES = 100_000  # values after expanding aliases
_MAX_COMPOSED = 20_000  # nodes in the text itself (a shipped manifest has a few hundred)


class _Counting(yaml.composer.Composer):
    """PyYAML's composer, stopping after ``_MAX_COMPOSED`` nodes; events come from the parser mixed in."""

    def _start(self, file: str) -> None:
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)  # type: ignore[arg-type]
        yaml.resolver.Resolver.__init__(self)  # type: ignore[arg-type]
        self._file = file
        self._composed = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._composed += 1
        if self._composed > _MAX_COMPOSED:
            mark = self.peek_event().start_mark  # type: ignore[attr-defined]
            raise ManifestError([Problem(self._file, mark.line + 1, "",
                                         f"more than {_MAX_COMPOSED} YAML nodes: not a manifest")])
        return super().compose_node(parent, index)


class _PyLoader(_Counting, yaml.parser.Parser, yaml.scanner.Scanner, yaml.reader.Reader,
                yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """All in Python: PyYAML's most precise error messages."""

    def __init__(self, stream: str, file: str) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        self._start(file)


try:  # libyaml's event parser, where PyYAML has it: about ten times faster on large input
    from yaml.cyaml import CParser

    class _CLoader(_Counting, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """libyaml makes the events, PyYAML's composer (and so the node count) is the same."""

        def __init__(self, stream: str, file: str) -> None:
            CParser.__init__(self, stream)
            self._start(file)

    _FAST: type[_Counting] | None = _CLoader
except ImportError:
    _FAST = None


_CORE_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}


class _Builder:
    def __init__(self, file: str, loader: _Counting) -> None:
        self.file = file
        self.loader = loader
        self.lines: dict[FieldPath, int] = {}
        self.count = 0

    def fail(self, node: yaml.Node, path: FieldPath, message: str) -> ManifestError:
        return ManifestError([Problem(self.file, node.start_mark.line + 1, field_name(path), message)])

    def build(self, node: yaml.Node, path: FieldPath) -> Any:
        self.count += 1
        if self.count > _MAX_NODES:
            raise self.fail(node, path, f"document expands to more than {_MAX_NODES} values")
        self.lines.setdefault(path, node.start_mark.line + 1)
        if node.tag not in _CORE_TAGS:
            raise self.fail(node, path, f"YAML tag {node.tag!r} is not allowed (only plain data)")
        if isinstance(node, yaml.MappingNode):
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                    raise self.fail(key_node, path, "mapping keys must be plain strings")
                key = key_node.value
                if key in result:
                    raise self.fail(key_node, (*path, key), "duplicate key")
                self.lines[(*path, key)] = key_node.start_mark.line + 1
                result[key] = self.build(value_node, (*path, key))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, LookupError, TypeError, ArithmeticError) as exc:
            # An explicit core tag on a scalar it cannot read (`!!int abc`, `!!bool maybe`), or an
            # integer longer than Python converts: PyYAML raises plain Python errors for these.
            message = str(exc) if len(str(exc)) <= 200 else str(exc)[:200] + "…"
            raise self.fail(node, path, f"cannot read {node.tag} value: {message}") from None


def load(text: str | bytes, file: str) -> tuple[Any, dict[FieldPath, int]]:
    """Parse one YAML document; raise ManifestError (with file and line) on any problem."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = text.count(b"\n", 0, exc.start) + 1
            raise ManifestError([Problem(file, line, "", f"not UTF-8 text ({exc.reason})")]) from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise ManifestError([Problem(file, line, "", "binary data (NUL byte) in a YAML file")])
    if _FAST is not None:
        try:
            return _parse(_FAST, text, file)
        except yaml.YAMLError:
            pass  # parsed again below, for PyYAML's more precise message
    try:
        return _parse(_PyLoader, text, file)
    except yaml.MarkedYAMLError as exc:
        # An unterminated construct is best reported where it starts, not at the end of the file.
        at_end = "end of stream" in str(exc.problem or "")
        mark = (exc.context_mark if at_end and exc.context_mark else None) or exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        message = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise ManifestError([Problem(file, line, "", f"invalid YAML: {message}")]) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        raise ManifestError([Problem(file, line, "", f"invalid character {exc.character!r} in YAML")]) from None
    except yaml.YAMLError as exc:
        raise ManifestError([Problem(file, 1, "", f"invalid YAML: {exc}")]) from None


def _parse(loader_type: type[_Counting], text: str, file: str) -> tuple[Any, dict[FieldPath, int]]:
    loader = loader_type(text, file)  # type: ignore[call-arg]
    try:
        node = loader.get_single_node()
        if node is None:
            raise ManifestError([Problem(file, 1, "", "empty document")])
        builder = _Builder(file, loader)
        return builder.build(node, ()), builder.lines
    finally:
        loader.dispose()
