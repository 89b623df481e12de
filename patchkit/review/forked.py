"""Run one function in a forked child process and collect its JSON-able result.

The review commands parse a vLLM tree with ``ast``, which holds the GIL: a second core helps only
from a second process. ``start(fn)`` forks; the child runs ``fn()``, writes its result as JSON to a
pipe and leaves with ``os._exit`` (no cleanup, no output of its own). ``Child.result()`` waits for it.

Contract and limits:

- ``available()`` is false where ``os.fork`` is missing, on one core, and in a process that runs
  other Python threads (a child forked there could inherit a lock another thread held); callers
  then do the work in-process.
- The child shares nothing with the parent after the fork; it must not use objects that hold a
  file position (an open ``ZipFile``): it opens what it reads itself.
- Any failure in the child (an exception, a crash, a result that is not JSON) reads as ``None``:
  the caller does the work in-process, where the same error surfaces with its own message.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any


def available() -> bool:
    """Whether forking a worker is safe and can help here."""
    return hasattr(os, "fork") and (os.cpu_count() or 1) > 1 and threading.active_count() == 1


class Child:
    """A forked child computing one result."""

    def __init__(self, pid: int, fd: int) -> None:
        self._pid, self._fd = pid, fd

    def result(self) -> Any | None:
        """The child's result, or None when it failed (see the module docstring)."""
        chunks = []
        try:
            while chunk := os.read(self._fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self._fd)
            _, status = os.waitpid(self._pid, 0)
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            return None
        try:
            return json.loads(b"".join(chunks))
        except ValueError:
            return None


def start(fn: Callable[[], Any]) -> Child:
    """Fork a child that runs ``fn()`` and sends back its JSON-able result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read_fd)
            data = memoryview(json.dumps(fn()).encode())
            while data:
                data = data[os.write(write_fd, data):]
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return Child(pid, read_fd)
