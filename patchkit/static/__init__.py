"""A static model of a vLLM source tree: targets, fingerprints and alias sites without importing vLLM.

Public API:

- ``open_tree(spec)`` → ``SourceTree`` for ``"installed"``, a folder or a ``.whl``
  (``TreeError`` for anything else);
- ``Resolver(tree)`` — ``resolve_target('module:qualname')`` → ``Resolution``,
  ``find_definitions(qualname)`` (where a moved target went), ``overrides(cls, name)``
  (subclasses that define a method themselves);
- ``alias_sites(...)`` — every import that binds a module-level target, with
  whether the entry's ``rebind`` scope covers it;
- ``call_paths(resolver, target)`` — callers that choose, by a condition, between the
  target and a same-named object of another module (``patchkit.static.callpaths``);
- ``analyze(tree, entry, packages)`` → ``TargetReport``: all of the above for one
  manifest entry, the verdict included.

Fingerprints come from ``patchkit.fingerprint.of_node`` on the parsed file, the
same function the runtime applies to ``inspect.getsource``, so a static
``ok`` means the runtime check passes too.

Speed: a tree's files are read once (bytes); only files whose text contains a
name in question are parsed, so a whole-tree check costs a fraction of parsing
every file.
"""

from __future__ import annotations

from patchkit.static.analyze import TargetReport, analyze
from patchkit.static.callpaths import CallPath, call_paths
from patchkit.static.resolve import Definition, ModuleRef, Override, Resolution, Resolver, source_segment
from patchkit.static.sites import AliasSite, alias_sites
from patchkit.static.tree import SourceTree, TreeError, open_tree

__all__ = [
    "AliasSite", "CallPath", "Definition", "ModuleRef", "Override", "Resolution", "Resolver", "SourceTree",
    "TargetReport", "TreeError", "alias_sites", "analyze", "call_paths", "open_tree", "source_segment",
]
