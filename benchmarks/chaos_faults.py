"""The chaos benchmark's faults, each a function of a ``Deployment`` that returns when the fault has ended.

Every fault returns the monotonic time its fault ended (recovery is counted from there) and leaves the deployment
as it found it: servers running (restarted where killed), names resolving, links up, the token file private, the
diagnostics filesystem emptied of its filler. ``T`` below is the deployment's ``timeout_s``.

``stop_ffn`` / ``stop_attention``  SIGSTOP the server's whole session for 3 T, then SIGCONT.
``kill_ffn`` / ``kill_attention``  SIGKILL the session and start the server again; ends when it is healthy.
``name``     the FFN's name stops resolving in the attention namespaces, the FFN's link goes down for 2 T (the
             group breaks), comes up, and the name resolves again 2 s later: re-formation first fails on the name.
``token``    the token file is mode 0644 (a careless rotation) while the FFN's link is down for 2 T; private again
             2 s after the link is back.
``disk``     the tmpfs holding every server's trace and metrics directories is filled to the last byte for 5 s.
``link``     the FFN namespace's ``eth0`` down for 5 s.
``trickle``  a stranger in its own namespace holds 4 connections to the FFN's AFD port (a dropped one is opened
             again) and sends one byte on each every 0.5 s for 8 s.
``no_step``  the main thread of an attention engine core (the one that steps) is held for 3 T through ptrace
             (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT`` stop that thread alone); its other threads, the connector's
             keep-alive sender among them, run on. The FFN's serve thread has no name visible from outside
             (Python does not name kernel threads), so the FFN side of this fault is not reachable this way.
``mixed``    overlapping: trickle from 0 s, the disk full from 1 s, attention ``attn<last>`` stopped from 2 s for 3 T,
             the FFN killed at 3 s with its name unresolvable until 2 s after it is back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from benchmarks.chaos_deploy import AFD_PORT, NAME, Deployment

Fault = Callable[[Deployment], float]
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT, _WALL = 17, 0x4206, 0x4207, 0x40000000


def stop_ffn(d: Deployment) -> float:
    return _stop(d, "ffn")


def stop_attention(d: Deployment) -> float:
    return _stop(d, d.attention[-1])


def _stop(d: Deployment, label: str) -> float:
    server = d.servers[label]
    server.signal(signal.SIGSTOP)
    try:
        time.sleep(3 * d.timeout_s)
    finally:
        server.signal(signal.SIGCONT)
    return time.monotonic()


def kill_ffn(d: Deployment) -> float:
    d.restart("ffn")
    return time.monotonic()


def kill_attention(d: Deployment) -> float:
    d.restart(d.attention[-1])
    return time.monotonic()


def _link_down(d: Deployment, seconds: float) -> None:
    d.lab.link("ffn", False)
    try:
        time.sleep(seconds)
    finally:
        d.lab.link("ffn", True)


def name(d: Deployment) -> float:
    d.names_resolve(False)
    try:
        _link_down(d, 2 * d.timeout_s)
        time.sleep(2.0)
    finally:
        d.names_resolve(True)
    return time.monotonic()


def token(d: Deployment) -> float:
    d.token.chmod(0o644)
    try:
        _link_down(d, 2 * d.timeout_s)
        time.sleep(2.0)
    finally:
        d.token.chmod(0o600)
    return time.monotonic()


def disk(d: Deployment, seconds: float = 5.0) -> float:
    filler = d.diag / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096):  # megabytes, then the last pages
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
        time.sleep(seconds)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            filler.unlink()
    return time.monotonic()


def link(d: Deployment) -> float:
    _link_down(d, 5.0)
    return time.monotonic()


_TRICKLE = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks = [None] * 4
end = time.monotonic() + seconds
while time.monotonic() < end:
    for i, s in enumerate(socks):
        try:
            if s is None:
                s = socks[i] = socket.create_connection((host, port), timeout=1)
            s.send(b"\\x17")
        except OSError:
            if s is not None:
                s.close()
            socks[i] = None
    time.sleep(0.5)
"""


def trickle(d: Deployment, seconds: float = 8.0) -> float:
    import subprocess

    proc = subprocess.Popen(d.lab.command("stranger", [sys.executable, "-c", _TRICKLE, NAME, str(AFD_PORT),
                                                       str(seconds)]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(seconds + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return time.monotonic()


def hold_thread(tid: int, seconds: float) -> None:
    """Stop thread ``tid`` alone for ``seconds`` (ptrace seize + interrupt, then detach); ``OSError`` if refused.
    Runs on the calling thread throughout (a tracer is a thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(_PTRACE_SEIZE, tid, None, None) != 0:
        raise OSError(ctypes.get_errno(), f"PTRACE_SEIZE {tid}")
    try:
        if libc.ptrace(_PTRACE_INTERRUPT, tid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"PTRACE_INTERRUPT {tid}")
        os.waitpid(tid, _WALL)
        time.sleep(seconds)
    finally:
        libc.ptrace(_PTRACE_DETACH, tid, None, None)


def no_step(d: Deployment) -> float:
    pid = d.servers[d.attention[-1]].engine_core()
    if pid is None:
        raise RuntimeError("no engine-core process found under the attention server")
    hold_thread(pid, 3 * d.timeout_s)  # a process's main thread has the process's id
    return time.monotonic()


def mixed(d: Deployment) -> float:
    """See the module docstring; ends when the last of its faults has."""
    ends: list[float] = []
    errors: list[BaseException] = []

    def after(delay: float, fault: Fault) -> threading.Thread:
        def run() -> None:
            time.sleep(delay)
            try:
                ends.append(fault(d))
            except Exception as e:  # noqa: BLE001 -- re-raised by mixed() itself
                errors.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def ffn_without_name(dep: Deployment) -> float:
        dep.names_resolve(False)
        try:
            dep.restart("ffn")
            time.sleep(2.0)
        finally:
            dep.names_resolve(True)
        return time.monotonic()

    threads = [after(0.0, lambda dep: trickle(dep, 20.0)), after(1.0, lambda dep: disk(dep, 8.0)),
               after(2.0, stop_attention), after(3.0, ffn_without_name)]
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(ends)


FAULTS: dict[str, Fault] = {
    "stop_ffn": stop_ffn, "stop_attention": stop_attention, "kill_ffn": kill_ffn, "kill_attention": kill_attention,
    "name": name, "token": token, "disk": disk, "link": link, "trickle": trickle, "no_step": no_step, "mixed": mixed,
}
