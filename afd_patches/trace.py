"""An opt-in timeline of AFD steps as a Chrome-trace file (Perfetto and ``chrome://tracing`` open it).

Set ``AFD_TRACE_DIR`` to a directory of yours and every AFD role process writes
``afd-trace-<role>-<rank>-<pid>.json`` there: one complete event (``"ph": "X"``) per piece of work, on
one time axis for every process of the host (``time.monotonic_ns``, the clock all processes share):

- attention role, per layer and micro-batch (thread ``micro-batch k``): ``attention`` (from the previous
  answer, or the start of the micro-batch, to the send), ``send``, and ``wait`` (blocked for the FFN's
  answer; a micro-batch that handed the baton on is not waiting, it is parked, and shows nothing);
- FFN role (thread ``ffn``): ``ffn`` per served message (its FFN call), and ``send``.

Each event names its layer, micro-batch and step in ``args``. The file is the JSON-array form of the format
(``[`` then one event per line), appended as events happen, so a killed process leaves a readable file; at
most ``AFD_TRACE_MAX_EVENTS`` (default 20,000) events are written per process, then tracing stops.

Tracing is best-effort: it never raises into the role. A write that fails (any ``OSError``: ``ENOSPC`` on a
full disk, ``EFBIG`` past a file-size limit, ``EIO``) is logged once per errno, counted in
``vllm:afd_trace_write_failures`` (``afd_patches.metrics``), and its event dropped; the next event tries again, so
tracing resumes by itself once there is room (one line is logged then). A record is written at the file's last
whole line (``os.pwrite`` at a tracked offset) and a record cut short by a failed write is truncated away
(shrinking needs no free blocks), so the file holds whole lines only; the header ``[`` goes out with the first
record that can be written, if it could not be written at ``start``. Only if that truncation itself fails does
tracing stop for good (logged), leaving a partial last line that ``scripts/render_trace.py`` cannot parse. Events
that fail do not count towards ``AFD_TRACE_MAX_EVENTS``; a value of it that is not a whole number is logged and
the default used.

Files are created with ``O_EXCL | O_NOFOLLOW``, mode 0600, in a directory that must be a real directory
owned by this user and not writable by others; otherwise nothing is traced and one warning is logged.
``scripts/render_trace.py`` draws one step of such files as a PNG (docs/running.md, "Reading a trace").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from typing import Any

from afd_patches import LOGGER
from afd_patches.metrics import FailureLog

logger = logging.getLogger(LOGGER)

DIR_ENV = "AFD_TRACE_DIR"
MAX_EVENTS_ENV = "AFD_TRACE_MAX_EVENTS"
DEFAULT_MAX_EVENTS = 20000
HEADER = b"[\n"


def now_us() -> float:
    """The trace clock, in microseconds."""
    return time.monotonic_ns() / 1000.0


def read(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete events (``"ph": "X"``) of every ``*afd-trace-*.json`` file under ``directory``, read as data;
    a file a killed process left (no closing ``]``) included. What ``scripts/render_trace.py`` and the cost model
    of ``benchmarks.pingpong_model`` read."""
    from pathlib import Path

    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*afd-trace-*.json")):
        text = path.read_text().rstrip().rstrip(",")
        rows = json.loads(text + ("]" if not text.endswith("]") else ""))
        events.extend(e for e in rows if isinstance(e, dict) and e.get("ph") == "X")
    return events


def _max_events() -> int:
    raw = os.environ.get(MAX_EVENTS_ENV, str(DEFAULT_MAX_EVENTS))
    try:
        return int(raw)
    except ValueError:
        logger.warning("AFD trace: %s=%r is not a whole number; writing at most %d events",
                       MAX_EVENTS_ENV, raw, DEFAULT_MAX_EVENTS)
        return DEFAULT_MAX_EVENTS


class Tracer:
    """Appends events to this process's trace file; ``enabled`` is False (and every call a no-op) unless
    ``AFD_TRACE_DIR`` names a private directory. Neither ``start`` nor ``event`` raises."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._fd = -1
        self._size = 0  # bytes of whole records in the file (the header counts): where the next record goes
        self._left = 0
        self._pid = ""
        self._failures = FailureLog("AFD trace", "a write", "trace_write_failures",
                                    "the event is dropped and the next one tries again")

    def start(self, role: str, rank: int) -> bool:
        """Open ``afd-trace-<role>-<rank>-<pid>.json`` under ``AFD_TRACE_DIR``; True when tracing."""
        directory = os.environ.get(DIR_ENV)
        if not directory or self.enabled:
            return self.enabled
        try:
            st = os.stat(directory, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise PermissionError("not a directory of this user that only this user can write")
            path = os.path.join(directory, f"afd-trace-{role}-{rank}-{os.getpid()}.json")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            logger.warning("AFD trace: %s=%s cannot be used (%s); not tracing", DIR_ENV, directory, e)
            return False
        self._left = _max_events()
        self._pid = f"{role} {rank}"
        self.enabled = True
        with self._lock:
            self._append(b"")
        logger.info("AFD trace: writing %s", path)
        return True

    def event(self, name: str, thread: str, start_us: float, end_us: float, **args: Any) -> None:
        """One complete event ``name`` on ``thread`` from ``start_us`` to ``end_us`` (``now_us`` values)."""
        if not self.enabled:
            return
        line = json.dumps({"name": name, "ph": "X", "pid": self._pid, "tid": thread, "ts": round(start_us, 1),
                           "dur": round(max(end_us - start_us, 0.0), 1), "args": args}, default=str) + ",\n"
        with self._lock:
            if self._left <= 0:
                self.enabled = False
                return
            if self._append(line.encode()):
                self._left -= 1

    def _append(self, record: bytes) -> bool:
        """Write ``record`` (preceded by the header while the file has none) after the last whole record; True
        when all of it is in the file. On a failure, take back what part of it was written, log and count."""
        data = record if self._size else HEADER + record
        done = 0
        try:
            while done < len(data):
                written = os.pwrite(self._fd, data[done:], self._size + done)
                if written <= 0:  # a regular file says why instead; never spin here
                    raise OSError(errno.EIO, "the trace file took no bytes")
                done += written
        except OSError as e:
            self._failures.failed(e)
            if done:
                self._take_back()
            return False
        self._size += done
        self._failures.succeeded()
        return True

    def _take_back(self) -> None:
        """Cut the file back to its whole records; if even that fails, stop tracing (the last line stays
        partial)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as e:
            self.enabled = False
            logger.warning("AFD trace: cannot cut a partly written event off the trace file (%s); its last line "
                           "is partial, and tracing stops", errno.errorcode.get(e.errno or 0, e))


TRACER = Tracer()
