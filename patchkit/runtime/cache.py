"""The on-disk cache: where it is, how its files are read and written, and what it holds.

Validating YAML needs ``yaml``, ``jsonschema`` and ``packaging`` (well over
100 ms of imports), and fingerprinting a long vLLM method means reading and
parsing its source: too much for every vLLM process. The first process does
that work and stores the result as JSON; later processes read one small file.

Where. ``$PATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchkit`` (only when that
variable is an absolute path, as the XDG spec says), else ``~/.cache/patchkit``.

How. The directory may sit on a path other users can reach, so it is used only
when it is a real directory (not a symlink) that the effective user owns and
nobody else may write; patchkit creates it with mode 0700. Files inside are
opened relative to that directory's descriptor with ``O_NOFOLLOW | O_NONBLOCK``
and judged by ``fstat`` of the open descriptor (``read_own``, which ``patchkit
report`` uses too): a regular file, owned by the effective user, not group- or
world-writable, one link, at most ``MAX_BYTES``.
Anything else (a symlink, a FIFO, a hard link, a foreign owner, a huge file, an
unusable directory) is a miss: logged at debug level, never an exception, never
a wait. Files are written 0600 under a fresh name and renamed into place, so
concurrent processes at worst compute the same thing twice.

What. Data only, checked again when read; nothing read from here is executed.
- a plan (``plan-<key>.json``) is keyed by the SHA-256 of every manifest's and
  the schema's content, patchkit's plan format and version, the plugin's
  version, the vLLM version and commit, the tree judged, and Python (its full
  version: fingerprints of the AST may change with the minor). On read it must have
  the plan's exact shape, name one of the manifest files read for the key with that
  file's content hash, every callable it names must lie inside the
  packages the plugin declared when it called ``activate`` (not a list read
  from the cache file itself), and every file its verdict read must still have
  the size and modification time it had (``patchkit.verdict.Verdict.stale``: an
  edited or reinstalled vLLM is judged again);
  anything else is a miss and the plan is compiled again.
- fingerprints (``fingerprints.json``) are keyed by the SHA-256 of the source
  file's content plus the definition's first line, qualified name and the Python
  minor version, so an edited file never finds a stale value; values must look like
  fingerprints.
Only this user can write what is read here; such a user can already change
what this user's processes run, and a file they wrote is still data.

Limit: on a platform without ``O_NOFOLLOW`` and ``dir_fd`` support (Windows)
the cache is not used at all.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import stat
import sys
from typing import TYPE_CHECKING, Any

from patchkit import __version__

if TYPE_CHECKING:
    from collections.abc import Callable

    from patchkit.plan import Compiled, Runtime

MAX_BYTES = 1 << 20  # a compiled plan is a few KB; anything near this is not ours

_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))  # patchkit/
_SUPPORTED = hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd and hasattr(os, "geteuid")
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

logger = logging.getLogger("patchkit")


def schema_path(name: str) -> str:
    """A shipped JSON Schema, e.g. ``manifest.schema.json``: ``patchkit/_schemas/`` in a wheel,
    the repository's ``schemas/`` in a checkout or editable install."""
    packaged = os.path.join(_PACKAGE_DIR, "_schemas")
    folder = packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(_PACKAGE_DIR), "schemas")
    return os.path.join(folder, name)


def manifest_files(directory: str | os.PathLike[str]) -> list[str]:
    """The ``*.yaml`` files directly in ``directory``, sorted by name."""
    try:
        with os.scandir(directory) as it:
            return sorted(e.path for e in it if e.name.endswith(".yaml") and e.is_file())
    except OSError:
        return []


def cache_dir() -> str:
    """The cache directory's path (it may not exist, or may be refused when used)."""
    if os.environ.get("PATCHKIT_CACHE_DIR"):
        return os.path.abspath(os.environ["PATCHKIT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "patchkit")


def _open_cache_dir(create: bool) -> int | None:
    """A descriptor of the cache directory if it is ours alone, else None (logged at debug)."""
    if not _SUPPORTED:
        return None
    path = cache_dir()
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            logger.debug("patchkit: cache directory %s cannot be created (%s); not cached", path, exc)
            return None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if create:
            logger.debug("patchkit: cache directory %s cannot be opened (%s); not cached", path, exc)
        return None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        logger.debug("patchkit: cache directory %s is not this user's alone (owner %d, mode %o); not used",
                     path, st.st_uid, stat.S_IMODE(st.st_mode))
        return None
    return fd


def read_private(name: str) -> bytes | None:
    """The bytes of cache file ``name`` if it passes every check in the module docstring, else None."""
    dir_fd = _open_cache_dir(create=False)
    if dir_fd is None:
        return None
    try:
        return read_own(name, dir_fd=dir_fd)
    except UntrustedFile as exc:
        logger.debug("patchkit: cache file %s ignored: %s", name, exc)
    except OSError:  # absent or unreadable: a plain miss
        pass
    finally:
        os.close(dir_fd)
    return None


class UntrustedFile(OSError):
    """A file ``read_own`` refused; the message says why (``a symbolic link``, ``owned by uid 65534, ...``)."""


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def read_own(name: str | os.PathLike[str], dir_fd: int | None = None, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of file ``name`` (relative to ``dir_fd`` when given) if it is this user's own.

    Opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink fails, a FIFO does not wait for a writer) and judged by
    ``fstat`` of the open descriptor, not the path: a regular file, owned by the effective uid (not "or root"),
    not group- or world-writable, one link, at most ``max_bytes`` (also if it grows while read). Anything else
    raises ``UntrustedFile`` saying why; other failures (absent, no permission) raise their ``OSError``.
    Refused everywhere on a platform that cannot open without following a symlink. Used for the cache's files
    and for ``patchkit report``."""
    if not _SUPPORTED:
        raise UntrustedFile("this platform cannot open a file without following a symbolic link")
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFile("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        problem = _file_problem(st, max_bytes)
        if problem:
            raise UntrustedFile(problem)
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise UntrustedFile(f"grew past {max_bytes} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_problem(st: os.stat_result, max_bytes: int) -> str:
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({_KINDS.get(stat.S_IFMT(st.st_mode), 'of an unknown kind')})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return f"{st.st_nlink} hard links"
    if st.st_size > max_bytes:
        return f"{st.st_size} bytes, more than {max_bytes}"
    return ""


def write_private(name: str, data: bytes) -> None:
    """Write cache file ``name`` (mode 0600, temp name + rename); any OSError leaves no file."""
    dir_fd = _open_cache_dir(create=True)
    if dir_fd is None:
        return
    tmp = f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a planted link, never follows it
    except OSError as exc:
        logger.debug("patchkit: cache file %s not written: %s", name, exc)
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
    finally:
        os.close(dir_fd)


# -- what the cache holds --------------------------------------------------------------------------

FORMAT = "patchkit-plan-9"
_FINGERPRINTS = "fingerprints.json"
_HEX = frozenset("0123456789abcdef")


def _sha256_file(path: str) -> str:
    with open(path, "rb", buffering=0) as f:
        return hashlib.sha256(f.read()).hexdigest()


def _python_tag() -> str:
    return f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}"


def _load_json(name: str) -> Any:
    data = read_private(name)
    try:
        return json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None


def compiled(directory: str, runtime: Runtime, plugin_version: str,
             compile_plan: Callable[[list[str], Runtime], Compiled], packages: tuple[str, ...] = ()) -> Compiled:
    """``compile_plan(files, runtime)`` for the manifests in ``directory``, read from the cache when it fits.

    ``packages``: the packages the plugin itself declares (``activate``); a cached plan must stay inside
    them, whatever list it carries. The caller passes ``compile_plan``
    (``patchkit.manifest.select.compile_plan``) so that the runtime layer never imports the manifest layer;
    it runs only on a miss."""
    files = manifest_files(directory)
    digests = {p: _sha256_file(p) for p in files}
    h = hashlib.sha256(f"{FORMAT}|{__version__}|{plugin_version}|{','.join(sorted(packages))}".encode())
    for p in [*files, schema_path("manifest.schema.json")]:
        h.update(f"{p}|{digests.get(p) or _sha256_file(p)}\n".encode())
    h.update(f"{runtime.vllm_version}|{runtime.vllm_commit}|{runtime.tree}|{_python_tag()}".encode())
    name = f"plan-{h.hexdigest()[:32]}.json"
    cached = _plan_from_json(_load_json(name), digests, packages)
    if cached is not None:
        return cached
    result = compile_plan(files, runtime)
    write_private(name, json.dumps({"format": FORMAT, "plan": result.to_json()}).encode())
    return result


def outside(plan: Compiled, packages: tuple[str, ...]) -> list[str]:
    """The callables ``plan`` names outside ``packages`` (the plugin's own declaration), else outside the
    packages its manifest lists; a manifest that lists a package the plugin did not declare counts too."""
    manifest = plan.manifest
    if manifest is None:
        return []
    allowed = set(packages or manifest.packages)
    refs = [*(r for e in manifest.entries for r in e.refs()), *(m.class_ref for m in manifest.models)]
    bad = [f"package {p}" for p in manifest.packages if p not in allowed]
    return bad + [str(r) for r in refs if not isinstance(r, str) or r.partition(":")[0].split(".")[0] not in allowed]


def _plan_from_json(data: Any, digests: dict[str, str], packages: tuple[str, ...]) -> Compiled | None:
    """The cached plan if it has the right shape, agrees with the files on disk and names nothing outside
    ``packages`` (see ``outside``), else None."""
    from patchkit.plan import Compiled

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    try:
        plan = Compiled.from_json(data["plan"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    manifest = plan.manifest
    if manifest is None:
        return plan if isinstance(plan.error, str) else None
    on_disk = {os.path.normpath(f): sha for f, sha in digests.items()}
    if not manifest.chain or any(on_disk.get(os.path.normpath(f)) != sha for f, sha in manifest.chain):
        return None  # a file of the extends chain changed (or is not in the folder): compile again
    changed = plan.verdict.stale() if plan.verdict is not None else None
    if changed:
        logger.info("patchkit: the vLLM tree changed since its verdict (%s): judging it again", changed)
        return None
    return None if outside(plan, packages) else plan


class Fingerprints:
    """Fingerprints of live definitions, cached by the content of their source file.

    ``of(func)`` returns the fingerprint ``patchkit.fingerprint.of_object`` would
    compute, from the cache when the same file content, line and qualname were
    fingerprinted before. ``flush()`` stores new values (merged with the file).
    """

    def __init__(self) -> None:
        self._data: dict[str, str] | None = None
        self._new: dict[str, str] = {}
        self._file_digests: dict[str, str] = {}  # several targets often share one source file

    def of(self, func: Any) -> str | None:
        key = self._source_key(func)
        if key is not None:
            if self._data is None:
                self._data = _valid_fingerprints(_load_json(_FINGERPRINTS))
            if key in self._data:
                return self._data[key]
        from patchkit import fingerprint

        value = fingerprint.of_object(func)
        if key is not None and value:
            self._data[key] = self._new[key] = value  # type: ignore[index]
        return value

    def flush(self) -> None:
        if self._new:
            merged = {**_valid_fingerprints(_load_json(_FINGERPRINTS)), **self._new}
            write_private(_FINGERPRINTS, json.dumps(merged).encode())
            self._new = {}


    def _source_key(self, func: Any) -> str | None:
        """``sha256(file content)|first line|qualname`` of the code under ``func``, or None."""
        import inspect

        func = getattr(func, "__func__", func)
        func = inspect.unwrap(func) if callable(func) else func
        code = getattr(func, "__code__", None)
        if code is None:
            return None
        file = code.co_filename
        if file not in self._file_digests:
            try:
                self._file_digests[file] = _sha256_file(file)
            except OSError:
                return None
        return f"{self._file_digests[file]}|{code.co_firstlineno}|{code.co_qualname}|{sys.version_info[1]}"


def _is_fingerprint(value: object) -> bool:
    """``ast<N>:<16 hex>:<16 hex>``, the only shape a cached fingerprint may have."""
    if not isinstance(value, str):
        return False
    prefix, _, rest = value.partition(":")
    sig, _, body = rest.partition(":")
    return (prefix.startswith("ast") and prefix[3:].isdigit() and len(sig) == len(body) == 16
            and _HEX.issuperset(sig) and _HEX.issuperset(body))


def _valid_fingerprints(data: Any) -> dict[str, str]:
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and _is_fingerprint(v)}
