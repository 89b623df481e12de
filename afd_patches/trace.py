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

Files are created with ``O_EXCL | O_NOFOLLOW``, mode 0600, in a directory that must be a real directory
owned by this user and not writable by others; otherwise nothing is traced and one warning is logged.
``scripts/render_trace.py`` draws one step of such files as a PNG (docs/running.md, "Reading a trace").
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import Any

from afd_patches import LOGGER

logger = logging.getLogger(LOGGER)

DIR_ENV = "AFD_TRACE_DIR"
MAX_EVENTS_ENV = "AFD_TRACE_MAX_EVENTS"


def now_us() -> float:
    """The trace clock, in microseconds."""
    return time.monotonic_ns() / 1000.0


class Tracer:
    """Appends events to this process's trace file; ``enabled`` is False (and every call a no-op) unless
    ``AFD_TRACE_DIR`` names a private directory."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._fd = -1
        self._left = 0
        self._pid = ""

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
        self._left = int(os.environ.get(MAX_EVENTS_ENV, "20000"))
        self._pid = f"{role} {rank}"
        os.write(self._fd, b"[\n")
        self.enabled = True
        logger.info("AFD trace: writing %s", path)
        return True

    def event(self, name: str, thread: str, start_us: float, end_us: float, **args: Any) -> None:
        """One complete event ``name`` on ``thread`` from ``start_us`` to ``end_us`` (``now_us`` values)."""
        if not self.enabled:
            return
        line = json.dumps({"name": name, "ph": "X", "pid": self._pid, "tid": thread, "ts": round(start_us, 1),
                           "dur": round(max(end_us - start_us, 0.0), 1), "args": args}) + ",\n"
        with self._lock:
            if self._left <= 0:
                self.enabled = False
                return
            self._left -= 1
            os.write(self._fd, line.encode())


TRACER = Tracer()
