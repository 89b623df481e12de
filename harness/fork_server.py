"""A fork server for the tests' engines: vLLM is imported once, and each engine is a fresh fork of that process.

Why: an engine process spends about 12.5 s of its ~20 s of CPU importing ``vllm`` (``from vllm import LLM``,
measured on this project's 2-core host), and the suite starts well over a hundred of them. Here one server
process imports what ``python -m harness.engine`` imports before it builds its ``LLM`` (vLLM, ``harness.engine``)
and then forks one child per engine; the child becomes that engine (its own session, its log on stdout/stderr,
its environment, ``sys.argv``) and runs ``harness.engine`` as ``__main__``, exactly as ``python -m`` would.

The contract: a forked engine is in the state a fresh ``python -m harness.engine`` process is in when it reaches
``LLM(...)``. Nothing of AFD or patchkit is loaded before the fork (the server refuses to serve if importing vLLM
loaded a plugin), vLLM's environment cache is off (its variables are read when used), and the server never
starts a thread, so the fork copies one thread. The plugin's hook then runs in the child, as vLLM calls it.

Limits, and how they are kept:
- A variable read while modules are imported would keep the server's value in the child. So a child's
  environment may differ from the server's only in ``RUNTIME_ENV`` (variables vLLM, patchkit and AFD read when
  they are used; checked against vLLM's source: none of them is read at module level). ``forkable(env)`` says
  whether an environment qualifies; ``harness.engine.start`` starts every other engine (Model Runner V2 under
  Triton's interpreter, a drifted ``PYTHONPATH``) as a fresh process.
- The server is the child's parent, not the test: exit codes come back over the server's socket
  (``ForkedProcess.poll``/``wait``, as ``subprocess.Popen`` has them: a signal is ``-signum``).
- Used only where ``ENV`` is ``1`` (the test session sets it); the demo and the benchmarks start every engine
  as a fresh process, as users run vLLM.

Run as ``python -m harness.fork_server FD`` (``cwd`` the repository root): FD is one end of a socket pair; requests
and replies are JSON lines on it. The server exits when the other end closes.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.env import REPO

ENV = "HARNESS_FORK_SERVER"
# Variables a forked engine may set differently from the server: read when used, never while importing.
RUNTIME_ENV = frozenset({
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS", "PATCHKIT_REPORT_DIR",
    "PATCHKIT_CACHE_DIR", "AFD_TOKEN", "PYTEST_CURRENT_TEST",
})
MODULE = "harness.engine"  # what the server preloads and its children run as __main__
READY_TIMEOUT_S = 300.0


def enabled() -> bool:
    """Whether engines are forked from the server in this process (``ENV`` is ``1``)."""
    return os.environ.get(ENV) == "1"


def server_env(env: dict[str, str]) -> dict[str, str]:
    """The environment a server for children with ``env`` starts with: ``env`` without ``RUNTIME_ENV``."""
    return {key: value for key, value in env.items() if key not in RUNTIME_ENV}


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a child with environment ``env`` may be forked from a server started with ``base``: the two differ
    only in ``RUNTIME_ENV``."""
    return all(env.get(key) == base.get(key) for key in (set(env) | set(base)) - RUNTIME_ENV)


class ForkedProcess:
    """A forked engine, as much of ``subprocess.Popen`` as the tests use: ``pid``, ``returncode``, ``poll``,
    ``wait``. Its exit code arrives from the server."""

    def __init__(self, server: Server, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked {MODULE} (pid {self.pid})", timeout or 0.0)
            self._server.wait_for_exit(min(left, 0.5) if left is not None else 0.5)
        assert self.returncode is not None
        return self.returncode


class Server:
    """The test side of one fork server: started on the first ``spawn``, ended when the test process exits."""

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = base_env
        ours, theirs = socket.socketpair()
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"harness-fork-server-{os.getpid()}.log"
        with log.open("wb") as fh:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], env=base_env,
                                          cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._log = log
        self._sock = ours
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._alive = True
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()
        if self._reply("ready", READY_TIMEOUT_S) is None:
            raise RuntimeError(f"fork server did not come up; its log:\n{self._tail()}")

    def _tail(self) -> str:
        return self._log.read_text(errors="replace")[-4000:] if self._log.exists() else "(no log)"

    def _read(self) -> None:
        try:
            for line in self._sock.makefile("rb"):
                message = json.loads(line)
                with self._changed:
                    if "exited" in message:
                        self._exits[message["exited"]] = message["code"]
                    else:
                        self._replies.append(message)
                    self._changed.notify_all()
        except OSError:
            pass  # closed by close()
        with self._changed:
            self._alive = False
            self._changed.notify_all()

    def _reply(self, key: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i, message in enumerate(self._replies):
                    if key in message:
                        return self._replies.pop(i)
                if not self._alive or time.monotonic() >= deadline:
                    return None
                self._changed.wait(deadline - time.monotonic())

    @property
    def alive(self) -> bool:
        return self._alive and self._proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code once the server reaped it; when the server itself is gone, 1 once the child is."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if self._alive:
                return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 1
        return None

    def wait_for_exit(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> ForkedProcess:
        """Fork a child that runs ``MODULE`` as ``__main__`` with ``sys.argv[1:] = argv``, environment ``env``, in
        its own session, stdout and stderr into ``log`` (created here, empty)."""
        log.write_bytes(b"")
        request = {"argv": argv, "log": str(log), "env": env, "cwd": str(REPO)}
        with self._send_lock:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            reply = self._reply("started", 60.0)
        if reply is None:
            raise RuntimeError(f"fork server did not start {argv}; its log:\n{self._tail()}")
        return ForkedProcess(self, reply["started"])

    def close(self) -> None:
        """End the server (it exits once its socket closes; the reader's file object holds the socket open, hence
        the shutdown). Engines it forked run on: each test ends its own."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


_SERVER: Server | None = None
_SERVER_LOCK = threading.Lock()


def server(base_env: dict[str, str]) -> Server:
    """This process's fork server for ``base_env`` (started on first use; a new one if the last one died)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive or _SERVER.base_env != base_env:
            if _SERVER is not None:
                _SERVER.close()
            _SERVER = Server(base_env)
            import atexit

            atexit.register(_SERVER.close)
        return _SERVER


# --- the server process --------------------------------------------------------------------------------------


def _preload() -> None:
    """Import what ``python -m harness.engine`` imports before ``LLM(...)``; refuse if that loaded a plugin."""
    import importlib

    importlib.import_module(MODULE)
    import vllm.envs
    from vllm import LLM  # noqa: F401  (what harness.engine.main imports first)

    loaded = sorted(name for name in ("afd_patches", "patchkit") if name in sys.modules)
    if loaded:
        raise SystemExit(f"fork server: importing vLLM loaded {loaded}; a forked engine would not be fresh")
    if getattr(vllm.envs, "_is_envs_cache_enabled", lambda: False)():
        raise SystemExit("fork server: vLLM's environment cache is on; a forked engine would keep these values")
    if threading.active_count() != 1:
        raise SystemExit(f"fork server: {threading.enumerate()} after the imports; a fork would copy one only")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer requests until the socket closes (returns None); in a forked child, return its request."""
    buffer = b""
    _send(sock, {"ready": True})
    while True:
        readable, _, _ = select.select([sock], [], [], 0.2)
        _reap(sock)
        if not readable:
            continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                return request
            _send(sock, {"started": pid})


def _become(request: dict[str, Any]) -> None:
    """In the child: its own session, its log as stdout/stderr, its working directory, environment and argv."""
    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [MODULE, *request["argv"]]


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _preload()
    request = _serve(sock)
    if request is None:
        return
    _become(request)
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
