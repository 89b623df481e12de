"""Where patchkit's inputs live, and how its cache files are read and written.

The cache directory is ``$PATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchkit``
(only when that variable is an absolute path, as the XDG spec says), else
``~/.cache/patchkit``. It holds JSON data only: a compiled plan and the
fingerprints of live code (``patchkit.plancache``). Nothing read from it is ever
executed, and every value is checked again when read.

The directory may sit on a path other users can reach, so it is used only when
it is a real directory (not a symlink) that the effective user owns and nobody
else may write; patchkit creates it with mode 0700. Files inside are opened
relative to that directory's descriptor with ``O_NOFOLLOW | O_NONBLOCK`` and
judged by ``fstat`` of the open descriptor: a regular file, owned by the
effective user, not group- or world-writable, one link, at most ``MAX_BYTES``.
Anything else (a symlink, a FIFO, a hard link, a foreign owner, a huge file, an
unreadable directory) is a miss: logged at debug level, never an exception,
never a wait. Files are written 0600 through a temporary name and a rename,
so concurrent processes at worst compute the same thing twice.

Limit: on a platform without ``O_NOFOLLOW`` and ``dir_fd`` support (Windows)
the cache is not used at all.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

MAX_BYTES = 1 << 20  # a compiled plan is a few KB; anything near this is not ours

_PACKAGE_DIR = os.path.dirname(__file__)
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
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:  # absent, a symlink (ELOOP), unreadable: a plain miss
        return None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        problem = _file_problem(st)
        if problem:
            logger.debug("patchkit: cache file %s ignored: %s", name, problem)
            return None
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= MAX_BYTES else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _file_problem(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return f"{st.st_nlink} hard links"
    if st.st_size > MAX_BYTES:
        return f"{st.st_size} bytes"
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


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) via a temp file + rename; OSError is ignored.

    For files a user asked for in a folder they chose (``PATCHKIT_REPORT_DIR``): no ownership rules."""
    import tempfile

    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
