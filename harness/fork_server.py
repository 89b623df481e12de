"""A fork server for the tests' vLLM processes: vLLM is imported once, and each engine is a fresh fork of that process.

Why: an engine process spends about 12.5 s of its ~20 s of CPU importing vLLM (``from vllm import LLM``, measured on
this project's 2-core host), and the suite starts well over a hundred of them. A server process imports what
``python -m harness.engine`` imports before it builds its ``LLM`` (vLLM, ``harness.engine``) and then forks one child
per start; the child becomes that process (its own session, its log on stdout and stderr, its working directory,
environment and ``sys.argv``) and runs its module as ``__main__``, as ``python -m`` would (``MODULES``: the engine
driver, the OpenAI API server, ``vllm serve``, the config probe). ``harness.starts.spawn`` goes through
``maybe_spawn``.

The contract: a forked child is in the state a fresh ``python -m harness.engine`` process is in before vLLM loads
its plugins. Nothing of AFD or patchkit is imported before the fork (the server refuses to serve if importing vLLM
loaded a plugin), vLLM's environment cache is off (its variables are read when used), and the server starts no
thread, so the fork copies one. The plugin's hook then runs in the child, where vLLM calls it.

Limits, and how they are kept:
- A variable read while a module is imported keeps the server's value in the child. So a server serves only
  children whose environment equals its own but for variables read when used (``read_when_used``: AFD's,
  patchkit's, which the server never imports, two of the harness's, and a few of vLLM's, read through ``vllm.envs``
  when used; checked in vLLM's source). Any other difference (a drifted ``PYTHONPATH``, Triton's interpreter for
  Model Runner V2) gets its own server, started for that environment (at most ``MAX_SERVERS`` live).
- The server is the child's parent, not the test: exit codes come back over the server's socket
  (``ForkedProcess.poll``/``wait``, as ``subprocess.Popen`` reports them: a signal is ``-signum``).
- A forked child differs from a fresh ``python -m`` of its module in what it imported beyond that module's own
  imports (the engine driver's: ``harness.tiny_model``, transformers), never in what vLLM or the plugin did.
- Only the process the test starts is forked: what vLLM starts in turn (an engine core or worker through
  ``multiprocessing``, its model-inspection subprocess) starts as vLLM starts it, fresh where vLLM spawns.
- Used only where ``ENV`` is ``1`` (the test session sets it; ``HARNESS_FORK_SERVER=0`` starts fresh processes);
  the demo and the benchmarks start every process fresh, as users run vLLM.

Run as ``python -m harness.fork_server FD`` (``cwd`` the repository root): FD is one end of a socket pair; requests
and replies are JSON lines on it. The server exits when the other end closes.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness.env import REPO

ENV = "HARNESS_FORK_SERVER"
# Variables a forked child may set differently from its server: none of the preloaded modules (vLLM, torch,
# transformers, harness) reads them while importing; vLLM reads its own through ``vllm.envs`` when used.
RUNTIME_NAMES = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS",
                           "PYTEST_CURRENT_TEST", "HARNESS_STARTS_DIR", ENV})
RUNTIME_PREFIXES = ("AFD_", "PATCHKIT_")  # read by afd_patches and patchkit, which the server never imports
MODULES = frozenset({"harness.engine", "harness.vllm_serve", "harness.config_probe",  # what a child may run
                     "vllm.entrypoints.openai.api_server"})
PRELOAD = "harness.engine"
MAX_SERVERS = 3  # one per distinct environment (less RUNTIME_NAMES); the least recently used one ends first
READY_TIMEOUT_S = 300.0


def enabled() -> bool:
    """Whether ``spawn`` forks in this process (``ENV`` is ``1``; the test session sets it)."""
    return os.environ.get(ENV) == "1"


def read_when_used(name: str) -> bool:
    """Whether the variable ``name`` may differ between a server and its child (``RUNTIME_NAMES``, prefixes)."""
    return name in RUNTIME_NAMES or name.startswith(RUNTIME_PREFIXES)


def server_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the server that forks a child with ``env``: ``env`` less what is read when used."""
    return {key: value for key, value in env.items() if not read_when_used(key)}


class ForkedProcess:
    """A forked engine, as much of ``subprocess.Popen`` as the tests use: ``pid``, ``returncode``, ``poll``,
    ``wait``. Its exit code arrives from the server."""

    def __init__(self, server: Server, pid: int, module: str) -> None:
        self._server = server
        self.pid = pid
        self.module = module
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
                raise subprocess.TimeoutExpired(f"forked {self.module} (pid {self.pid})", timeout or 0.0)
            self._server.wait_for_exit(min(left, 0.5) if left is not None else 0.5)
        assert self.returncode is not None
        return self.returncode


Process = subprocess.Popen[bytes] | ForkedProcess  # what harness.starts.spawn returns


class Server:
    """The test side of one fork server process (environment ``base_env``): ``spawn`` forks a child of it."""

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = base_env
        ours, theirs = socket.socketpair()
        fd, log = tempfile.mkstemp(prefix="harness-fork-server-", suffix=".log")  # a new file of ours, not a link
        with os.fdopen(fd, "wb") as fh:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], env=base_env,
                                          cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._log = Path(log)
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

    def spawn(self, module: str, argv: list[str], log: Path, env: dict[str, str]) -> ForkedProcess:
        """Fork a child that runs ``module`` as ``__main__`` with ``sys.argv[1:] = argv``, environment ``env``, in
        its own session, stdout and stderr into ``log`` (created here, empty)."""
        assert module in MODULES and server_env(env) == self.base_env, (module, "a child of another server")
        log.write_bytes(b"")
        request = {"module": module, "argv": argv, "log": str(log), "env": env, "cwd": str(REPO)}
        with self._send_lock:
            _send(self._sock, request)
            reply = self._reply("started", 60.0)
        if reply is None:
            raise RuntimeError(f"fork server did not start {module} {argv}; its log:\n{self._tail()}")
        return ForkedProcess(self, reply["started"], module)

    def close(self) -> None:
        """End the server (it exits once its socket closes; the reader's file object holds the socket open, hence
        the shutdown) and remove its log. Engines it forked run on: each test ends its own."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.unlink(missing_ok=True)


_SERVERS: dict[frozenset[tuple[str, str]], Server] = {}  # by environment, least recently used first
_LOCK = threading.Lock()


def maybe_spawn(args: list[str], log: Path, env: dict[str, str]) -> ForkedProcess | None:
    """``args`` forked from the server for ``env`` when this process forks (``enabled``) and ``args`` is
    ``[sys.executable, "-m", M, ...]`` with ``M`` in ``MODULES``; else None (the caller starts a fresh process).
    A server is started on first use for each environment (less what is read when used)."""
    if not enabled() or len(args) < 3 or args[:2] != [sys.executable, "-m"] or args[2] not in MODULES:
        return None
    base = server_env(env)
    key = frozenset(base.items())
    with _LOCK:
        found = _SERVERS.pop(key, None)
        if found is None or not found.alive:
            found = Server(base)
            atexit.register(found.close)
        _SERVERS[key] = found
        while len(_SERVERS) > MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()
    return found.spawn(args[2], args[3:], log, env)


# --- the server process --------------------------------------------------------------------------------------


def _preload() -> None:
    """Import what ``python -m harness.engine`` imports before ``LLM(...)``; refuse if that loaded a plugin."""
    import importlib

    importlib.import_module(PRELOAD)
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
    sys.argv = [request["module"], *request["argv"]]


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _preload()
    request = _serve(sock)
    if request is None:
        return
    _become(request)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
