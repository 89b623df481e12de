"""One AFD deployment behind vLLM's OpenAI server, each engine in a network namespace of its own (``netns.Lab``).

``Deployment`` starts the FFN server in namespace ``ffn`` and attention server ``r`` in ``attn<r>``, every one
listening on its namespace's address, port ``API_PORT``; the attention servers reach the FFN by the name ``NAME``
(each namespace's hosts file maps it to the FFN's address), ``--afd-port`` ``AFD_PORT``, ``--afd-timeout-s``
``timeout_s``, a group token file (mode 0600). Every server's ``TMPDIR`` (where the API server makes
``AFD_METRICS_DIR``) and ``AFD_TRACE_DIR`` lie on one small tmpfs (``diag``), so that a fault can fill it;
``VLLM_CPU_OMP_THREADS_BIND`` is ``nobind`` unless the environment sets it. A
namespace ``stranger`` is made for the trickling stranger. ``down`` holds the labels of servers being killed or
restarted (the load counts a refused connection to one of them as ``cut``, not ``lost``).

``stop_all()`` resumes (SIGCONT) and terminates every server's session, then kills what is left after 30 s.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.netns import Lab
from harness import starts
from harness.env import REPO, vllm_env

NAME = "ffn.afd.test"
API_PORT = 8000
AFD_PORT = 29650
START_TIMEOUT_S = 400.0
GATE = "Starting to load model"  # vLLM worker log line, just before the AFD group forms
ARCH = {"llama": "AFDLlamaForCausalLM", "qwen3_moe": "AFDQwen3MoeForCausalLM"}


class Server:
    """One API server tree in its own session inside namespace ``ns`` of ``lab``; output to ``log``."""

    def __init__(self, lab: Lab, label: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.lab, self.label, self.args, self.env, self.log = lab, label, args, env, log
        self.url = f"http://{lab.addresses[label]}:{API_PORT}"
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        starts.record("API server", f"chaos {self.label}")  # counted where a test session counts starts
        with self.log.open("ab") as fh:
            return subprocess.Popen(self.lab.command(self.label, self.args), env=self.env, stdout=fh,
                                    stderr=subprocess.STDOUT, cwd=self.log.parent, start_new_session=True)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered 200; ``RuntimeError`` on an early exit or after ``timeout_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            time.sleep(0.25)
        raise RuntimeError(f"{self.label} not healthy in {timeout_s:g}s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        """``sig`` to the server's whole session (front end, engine core, worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def restart(self) -> None:
        self.kill()
        self.proc = self._spawn()

    def engine_core(self) -> int | None:
        """The pid of the server's engine-core process (vLLM names it ``VLLM::EngineCore``), if found."""
        import psutil

        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                if "EngineCor" in p.name():
                    return int(p.pid)
        return None

    def stop(self) -> None:
        """Resume (it may be stopped), SIGTERM the session, SIGKILL what is left after 30 s."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


class Deployment:
    """See the module docstring. ``family``: ``llama`` or ``qwen3_moe``; ``model``: its checkpoint folder."""

    def __init__(self, lab: Lab, family: str, model: Path, ranks: int, timeout_s: float, work: Path,
                 hold_s: float | None = None, diag_size: str = "64m") -> None:
        self.lab, self.family, self.model, self.ranks, self.timeout_s, self.work = (lab, family, model, ranks,
                                                                                     timeout_s, work)
        self.hold_s = hold_s  # the attention servers' --afd-hold-s (None: the config's default)
        self.down: set[str] = set()
        for name in ("ffn", *(f"attn{r}" for r in range(ranks)), "stranger"):
            lab.add(name)
        self.ffn_address = lab.addresses["ffn"]
        self.names_resolve(True)
        self.token = work / "afd-token"
        self.token.write_text(secrets.token_hex(32))
        self.token.chmod(0o600)
        self.diag = lab.tmpfs(diag_size)
        self.servers: dict[str, Server] = {}

    @property
    def attention(self) -> list[str]:
        return [f"attn{r}" for r in range(self.ranks)]

    def names_resolve(self, on: bool, where: list[str] | None = None) -> None:
        """Whether ``NAME`` resolves in the namespaces ``where`` (default: all but the FFN's, which always does)."""
        for ns in where or [n for n in self.lab.addresses if n != "ffn"]:
            self.lab.hosts(ns, {NAME: self.ffn_address} if on else {})
        self.lab.hosts("ffn", {NAME: self.ffn_address})

    def _args(self, label: str) -> list[str]:
        role = ["--afd-role", "ffn"] if label == "ffn" else ["--afd-role", "attention", "--afd-rank", label[4:]]
        if label != "ffn" and self.hold_s is not None:
            role += ["--afd-hold-s", f"{self.hold_s:g}"]
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", self.lab.addresses[label], "--port", str(API_PORT), "--enforce-eager",
                "--max-model-len", "256", "--dtype", "float32", "--seed", "0", "--max-num-seqs", "16",
                "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", str(64 << 20),
                "--hf-overrides", json.dumps({"architectures": [ARCH[self.family]]}), *role,
                "--afd-host", NAME, "--afd-port", str(AFD_PORT), "--afd-timeout-s", f"{self.timeout_s:g}",
                "--afd-num-attention-ranks", str(self.ranks), "--afd-token-file", str(self.token)]

    def _env(self, label: str) -> dict[str, str]:
        tmp, trace = self.diag / f"tmp-{label}", self.diag / f"trace-{label}"
        for d in (tmp, trace):
            d.mkdir(mode=0o700, exist_ok=True)
        # torch's compile cache (precompiled headers: tens of MB) stays where it was: under TMPDIR it would land on
        # the small tmpfs, cold and soon full
        inductor = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        inductor.mkdir(exist_ok=True)
        if not (tmp / inductor.name).is_symlink():
            (tmp / inductor.name).symlink_to(inductor)
        env = vllm_env(PYTHONUNBUFFERED="1", TMPDIR=str(tmp), AFD_TRACE_DIR=str(trace))
        # vLLM's default binding (``auto``) puts every engine's worker on core 0 of this 2-core host, where a
        # restarting FFN waited minutes behind the attention worker's busy-poll; the namespaces stand for hosts
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        return env

    def start(self) -> float:
        """Start the FFN server, then (once it is healthy) every attention server, held together at their first
        formation (``_gate``); seconds until all are healthy."""
        t0 = time.monotonic()
        self.servers["ffn"] = self._server("ffn")
        self.servers["ffn"].wait_healthy()
        attention = {label: self._server(label) for label in self.attention}
        self.servers.update(attention)
        if len(attention) > 1:
            self._gate(list(attention.values()))
        for s in attention.values():
            s.wait_healthy()
        return time.monotonic() - t0

    def _server(self, label: str) -> Server:
        return Server(self.lab, label, self._args(label), self._env(label), self.work / f"{self.family}-{label}.log")

    @staticmethod
    def _gate(servers: list[Server], timeout_s: float = START_TIMEOUT_S) -> None:
        """SIGSTOP each attention server when its worker starts loading the model (vLLM logs ``GATE``), SIGCONT all
        once every one has. An attention engine waits at most ``timeout_s`` for its *first* group (the worker's
        ``AttentionGroup.start``), and a 2A1F group needs both ranks: servers started together on 2 busy cores
        reach that point seconds apart, and the first one's engine then fails to start."""
        held: set[int] = set()
        deadline = time.monotonic() + timeout_s
        try:
            while len(held) < len(servers) and time.monotonic() < deadline:
                for i, s in enumerate(servers):
                    if i not in held and GATE in s.tail(1 << 20):
                        s.signal(signal.SIGSTOP)
                        held.add(i)
                    elif s.proc.poll() is not None:
                        raise RuntimeError(f"{s.label} exited {s.proc.returncode}:\n{s.tail()}")
                time.sleep(0.05)
        finally:
            for s in servers:
                s.signal(signal.SIGCONT)

    def urls(self) -> dict[str, str]:
        return {label: self.servers[label].url for label in self.attention}

    def restart(self, label: str) -> float:
        """SIGKILL server ``label``'s session and start it again; seconds until it is healthy (counted ``down``)."""
        self.down.add(label)
        try:
            self.servers[label].restart()
            return self.servers[label].wait_healthy()
        finally:
            self.down.discard(label)

    def stop_all(self) -> None:
        for label in [*reversed(self.attention), "ffn"]:
            if label in self.servers:
                self.servers[label].stop()
