"""AFD behind vLLM's OpenAI-compatible server: the --afd-* flags, for real.

1. ``python -m vllm.entrypoints.openai.api_server --help`` lists the ``AFD`` group, and
   ``--help=AFD`` lists every ``--afd-*`` flag (the plugin adds them through its manifest).
2. A tiny float32 Llama (plus a tiny word-level tokenizer) is served as an AFD pair, shared by the
   module's tests, which run their checks on it in order (``pair``): the FFN role server first, then
   the attention role server, both configured with ``--afd-*`` flags (the FFN one also with
   ``--additional-config``, to show both forms combine). One greedy
   ``/v1/completions`` request (token-id prompt, ``return_tokens_as_token_ids``) to the
   attention server must give the same token ids and top-5 logprobs as plain offline vLLM
   (harness/engine.py) on the same checkpoint.
3. The same pair, the attention server's process group SIGKILLed: the FFN server notices the lost
   rank at once, logs that the group ended naming it, and stays up and healthy, waiting for a new
   group (an FFN engine outlives its attention engines' crashes); a new attention server is served.
4. The other direction: the FFN server SIGKILLed under streamed traffic; the attention server outlives
   it (requests fail naming AFD and host:port, /health unhealthy) and re-forms the group by itself when
   an FFN server is back on the same port; then a restarted attention server is served too.

Everything listens on 127.0.0.1 only; every wait is bounded; each server runs in its own
process group, which is terminated (then killed) in ``finally``. Marked ``vllm``: slow
(two servers, three processes each), needs the real vLLM CPU build.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from afd_patches.patches import cli_flags
from harness import starts
from harness.engine import tail
from harness.env import free_port, vllm_env

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 8: two --help front ends, the session's
# plain engine (plain_generation) and 5 API servers (the pair; the attention server after the kill; the FFN server
# after its kill; the attention server after a clean stop).
ENGINE_BUDGET = 8

HOST = "127.0.0.1"
PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 8
LOGPROBS = 5
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
HELP_TIMEOUT_S = 120.0
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def _env(**extra: str) -> dict[str, str]:
    # dev mode adds POST /collective_rpc (loopback only here), used to read the AFD workers' counters
    return vllm_env(PYTHONUNBUFFERED="1", VLLM_SERVER_DEV_MODE="1", **extra)


def test_api_server_help_lists_afd_flags() -> None:
    overview = starts.run([*SERVER, "--help"], _env(), HELP_TIMEOUT_S)
    assert overview.returncode == 0, overview.stderr[-3000:]
    assert any(line.strip().startswith("AFD ") for line in overview.stdout.splitlines()), overview.stdout[-3000:]
    group = starts.run([*SERVER, "--help=AFD"], _env(), HELP_TIMEOUT_S)
    assert group.returncode == 0, group.stderr[-3000:]
    for flag in (f.option for f in cli_flags.flags()):  # generated from AfdConfig, as the server's are
        assert flag in group.stdout, f"{flag} missing from --help=AFD:\n{group.stdout}"


def _server_args(model: Path, port: int, *extra: str) -> list[str]:
    return [*SERVER, "--model", str(model), "--host", HOST, "--port", str(port), "--enforce-eager",
            "--max-model-len", "256", "--dtype", "float32", "--seed", "0", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.2",
            "--kv-cache-memory-bytes", str(64 << 20), *extra]


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float, host: str = HOST) -> float:
    """Poll ``/health`` at ``host:port`` until 200; fail on early exit or after ``timeout_s``. Returns seconds
    waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"server on port {port} exited {proc.returncode} before it was healthy:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"server on port {port} not healthy within {timeout_s}s:\n{tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@contextmanager
def _servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list the test appends started servers to; all are stopped, last started first."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):  # attention first: its close ends the FFN serve loop cleanly
            _stop(proc)


def _start(procs: list[subprocess.Popen[bytes]], args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """Start one API server tree (counted: ``harness.starts``), output into ``log``; appended to ``procs``."""
    proc = starts.spawn("API server", args, log, _env(**env))
    procs.append(proc)
    return proc


def _post(port: int, path: str, body: dict[str, Any], host: str = HOST, headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def _complete(port: int, model: Path) -> dict[str, Any]:
    return _post(port, "/v1/completions", {
        "model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": LOGPROBS,
        "ignore_eos": True, "return_tokens_as_token_ids": True})


def _afd_stats(port: int) -> dict[str, Any]:
    """The single worker's ``afd_stats()`` via the dev-mode ``/collective_rpc`` endpoint."""
    (stats,) = _post(port, "/collective_rpc", {"method": "afd_stats", "timeout": 30})["results"]
    return stats


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text.split(":", 1)[1])


def _max_logprob_difference(plain: list[dict[str, float]], served: list[dict[str, float]]) -> float:
    """Largest |difference| between plain vLLM's top logprobs and a server's, step by step (same token sets)."""
    worst = 0.0
    for step_plain, step_served in zip(plain, served, strict=True):
        by_id = {str(_token_id(t)): v for t, v in step_served.items()}
        assert set(by_id) == set(step_plain)
        worst = max(worst, *(abs(v - by_id[t]) for t, v in step_plain.items()))
    return worst


OUTAGE_TIMEOUT_S = 5  # the pair's AFD timeout_s: in-flight requests must end within it when the FFN is killed


@dataclass
class Pair:
    """The module's AFD pair of API servers. Its tests run their checks on it in file order; one that restarts a
    server leaves the new process here (``procs`` holds every server started, all stopped at the end)."""

    procs: list[subprocess.Popen[bytes]]
    folder: Path
    afd_port: int
    ffn_port: int
    attn_port: int
    ffn_args: list[str]
    attn_args: list[str]
    ffn: subprocess.Popen[bytes]
    attn: subprocess.Popen[bytes]
    ffn_log: Path
    attn_log: Path
    healthy_s: tuple[float, float]  # FFN, attention: seconds from start to healthy
    token_file: Path  # the group's shared secret (mode 0600)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.afd_port}"

    def start_attention(self, log_name: str) -> None:
        self.attn_log = self.folder / log_name
        self.attn = _start(self.procs, self.attn_args, self.attn_log)
        _wait_healthy(self.attn, self.attn_port, self.attn_log, START_TIMEOUT_S)

    def start_ffn(self, log_name: str) -> None:
        self.ffn_log = self.folder / log_name
        self.ffn = _start(self.procs, self.ffn_args, self.ffn_log)
        _wait_healthy(self.ffn, self.ffn_port, self.ffn_log, START_TIMEOUT_S)


@pytest.fixture(scope="module")
def pair(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The FFN server, then the attention server, at ``timeout_s`` ``OUTAGE_TIMEOUT_S``. The attention server comes
    up far later than ``timeout_s`` after the FFN server: the FFN server waits for its first group as long as it
    takes. The attention server stops on SIGTERM with ``--shutdown-timeout 10``, time to close the group cleanly
    (vLLM's default, 0, kills the worker at once)."""
    folder = tmp_path_factory.mktemp("afd-server-pair")
    token_file = folder / "afd-token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    afd_port, ffn_port, attn_port = free_port(), free_port(), free_port()
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = ["--afd-port", str(afd_port), "--afd-host", HOST, "--afd-timeout-s", str(OUTAGE_TIMEOUT_S),
              "--afd-token-file", str(token_file), "--afd-hold-s", "0"]  # requests fail at once: no hold
    ffn_args = _server_args(model_dir, ffn_port, *arch, "--afd-role", "ffn", *common, "--additional-config",
                            json.dumps({"afd": {"connector_extra_config": {"idle_timeout_s": 900}}}))
    attn_args = _server_args(model_dir, attn_port, *arch, "--afd-role", "attention", *common,
                             "--shutdown-timeout", "10")
    with _servers() as procs:
        ffn_log, attn_log = folder / "ffn.log", folder / "attention.log"
        ffn = _start(procs, ffn_args, ffn_log)
        ffn_s = _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)
        attn = _start(procs, attn_args, attn_log)
        attn_s = _wait_healthy(attn, attn_port, attn_log, START_TIMEOUT_S)
        yield Pair(procs, folder, afd_port, ffn_port, attn_port, ffn_args, attn_args, ffn, attn, ffn_log, attn_log,
                   (ffn_s, attn_s), token_file)


def test_afd_pair_behind_openai_server_matches_plain_vllm(pair: Pair, model_dir: Path, plain_generation: Any) -> None:
    plain = plain_generation
    plain_tokens = plain.result["tokens"][0]
    plain_logprobs = plain.result["logprobs"][0]
    t1 = time.monotonic()
    response = _complete(pair.attn_port, model_dir)
    request_s = time.monotonic() - t1
    attn_stats, ffn_stats = _afd_stats(pair.attn_port), _afd_stats(pair.ffn_port)
    assert pair.ffn.poll() is None, f"FFN server died:\n{tail(pair.ffn_log)}"
    choice = response["choices"][0]
    lp = choice["logprobs"]
    tokens = [_token_id(t) for t in lp["tokens"]]
    assert tokens == plain_tokens, f"AFD server {tokens} != plain vLLM {plain_tokens}"
    worst = _max_logprob_difference(plain_logprobs, lp["top_logprobs"])
    assert worst == 0.0, f"max |logprob difference| {worst}"
    # the roles really ran disaggregated: the attention worker holds no MLP weights and sent every
    # layer's MLP input to the FFN worker, which has no KV cache and answered each one
    assert attn_stats["role"] == "attention" and attn_stats["mlp_param_names"] == []
    assert attn_stats["kv_cache_bytes"] > 0 and attn_stats["messages_sent"] > 0
    assert ffn_stats["role"] == "ffn" and ffn_stats["kv_cache_bytes"] == 0 and ffn_stats["attn_param_names"] == []
    assert ffn_stats["messages_received"] == attn_stats["messages_sent"] == attn_stats["messages_received"]
    ffn_s, attn_s = pair.healthy_s
    print(f"AFD server: tokens {tokens} equal plain vLLM; max |dlogprob| {worst:.1e}; "
          f"FFN server healthy in {ffn_s:.1f}s, attention server in {attn_s:.1f}s, request {request_s:.2f}s; "
          f"{attn_stats['messages_sent']} layer messages exchanged")


def test_attention_server_killed_the_ffn_server_waits_for_a_new_group(pair: Pair, model_dir: Path) -> None:
    """SIGKILL the attention server's process group: the FFN server notices the lost rank at once (its socket
    closes), logs that the group ended naming it, and stays up and healthy, waiting for a new group; a new
    attention server on the same ports is served."""
    before = [_token_id(t) for t in _complete(pair.attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]]
    assert len(before) == MAX_TOKENS
    os.killpg(pair.attn.pid, signal.SIGKILL)
    pair.attn.wait(30)
    t0 = time.monotonic()
    while "waiting for a new group" not in (log := tail(pair.ffn_log, 20000)):
        assert pair.ffn.poll() is None, f"the FFN server exited after the attention server was killed:\n{log[-3000:]}"
        assert time.monotonic() - t0 < 30, f"the FFN server did not notice the lost rank:\n{log[-3000:]}"
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    assert "the group ended" in log and "lost attention rank 0" in log, log[-3000:]
    time.sleep(2)
    assert pair.ffn.poll() is None, tail(pair.ffn_log)
    _wait_healthy(pair.ffn, pair.ffn_port, pair.ffn_log, 10)
    pair.start_attention("attention-after-kill.log")
    again = [_token_id(t) for t in _complete(pair.attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]]
    assert again == before and pair.ffn.poll() is None, (before, again)
    print(f"FFN server noticed the killed attention server within {elapsed:.1f}s and served a new one")


STREAMS = 3
STREAM_TOKENS = 240  # long enough to be in flight when the FFN is killed


def stream_events(port: int, model: Path, **body: Any) -> Iterator[dict[str, Any]]:
    """The events of one streamed greedy completion of ``PROMPT`` (``body`` adds to or overrides the request);
    raises ``OSError`` or ``ValueError`` where the connection or an event breaks."""
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, **body}
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _stream(port: int, model: Path, out: dict[str, Any]) -> None:
    """One streamed completion; records when its first chunk and its end came, and the error event it ended with."""
    try:
        for event in stream_events(port, model):
            out.setdefault("first", time.monotonic())
            if "error" in event:
                out["error"] = event["error"]
    except (OSError, ValueError) as e:  # recorded, judged by the test
        out["exception"] = repr(e)
    out["end"] = time.monotonic()


def _http_error(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, str, float]:
    """(status, body, seconds) of a request expected to fail; fails the test if it succeeds."""
    t0 = time.monotonic()
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            pytest.fail(f"{path} answered {r.status} during the FFN outage: {r.read()[:500]!r}")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), time.monotonic() - t0


def attention_sample(port: int, name: str) -> float | None:
    """The value of the attention role's sample ``name`` on the server's ``/metrics``; None if absent."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and 'role="attention"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def _group_up_gauge(port: int) -> float | None:
    return attention_sample(port, "vllm:afd_group_up")


def _wait_gauge(port: int, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := _group_up_gauge(port)) != value:
        assert time.monotonic() < deadline, f"vllm:afd_group_up is {seen}, expected {value}"
        time.sleep(0.2)


def test_attention_server_outlives_ffn_restart(pair: Pair, model_dir: Path) -> None:
    """SIGKILL the FFN server under streamed traffic: the in-flight requests end within ``timeout_s`` with an error
    naming AFD and the FFN's host:port, /health is unhealthy, a new request fails fast with that error. While the FFN
    is down the group's token file is mode 0644 for a moment (a careless rotation): the attention side's attempts to
    re-form fail on it, logged once. Restart the FFN server on the same ports once the file is private again: the
    same attention server re-forms the group by itself within 2 x ``timeout_s`` and gives the same greedy tokens
    (issue 51, finding 1: the first failed attempt used to kill the re-forming thread, and the engine never served
    again). Then stop the attention server cleanly and start another: the FFN server serves the new one."""
    import threading

    attn_port, address, first_ffn_log = pair.attn_port, pair.address, pair.ffn_log
    before = [_token_id(t) for t in _complete(attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]]
    _wait_gauge(attn_port, 1.0)

    results: list[dict[str, Any]] = [{} for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(attn_port, model_dir, r), daemon=True) for r in results]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all("first" in r for r in results):
        assert time.monotonic() < deadline and not any("end" in r for r in results), results
        time.sleep(0.02)
    pair.token_file.chmod(0o644)  # a careless rotation: every re-formation attempt from here on fails on it
    os.killpg(pair.ffn.pid, signal.SIGKILL)
    killed = time.monotonic()
    pair.ffn.wait(30)
    for t in threads:
        t.join(OUTAGE_TIMEOUT_S + 30)
    for r in results:
        assert "end" in r and "exception" not in r, r
        assert r["end"] - killed <= OUTAGE_TIMEOUT_S, f"a request ended {r['end'] - killed:.1f}s after the kill"
        message = r.get("error", {}).get("message", "")
        assert "AFD" in message and address in message, r
    ended_s = max(r["end"] for r in results) - killed

    status, body, _ = _http_error(attn_port, "/health")
    assert status >= 500 and "AFD" in body and address in body, (status, body)
    status, body, new_s = _http_error(attn_port, "/v1/completions", {
        "model": str(model_dir), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status >= 500 and "AFD" in body and address in body, (status, body)
    assert new_s < OUTAGE_TIMEOUT_S, f"a new request took {new_s:.1f}s to fail"
    _wait_gauge(attn_port, 0.0)
    assert pair.attn.poll() is None, tail(pair.attn_log)

    try:
        deadline = time.monotonic() + 30
        while "a group did not form at" not in (log := tail(pair.attn_log, 50000)):
            assert time.monotonic() < deadline, f"no failed re-formation attempt logged:\n{log[-3000:]}"
            time.sleep(0.2)
        time.sleep(OUTAGE_TIMEOUT_S)  # attempts go on failing meanwhile; their pause reaches timeout_s
    finally:
        pair.token_file.chmod(0o600)
    assert pair.attn.poll() is None and "Exception in thread" not in tail(pair.attn_log, 50000)

    restarted = time.monotonic()
    pair.start_ffn("ffn-2.log")
    ffn_up = time.monotonic()
    while True:  # the attention server re-forms the group by itself; nothing is sent to it but requests
        try:
            after = [_token_id(t) for t in _complete(attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]]
            break
        except urllib.error.HTTPError as e:
            assert time.monotonic() - ffn_up < 60, f"no group 60s after the FFN was back: {e.read()[:300]!r}"
            time.sleep(0.1)
    recovered = time.monotonic()
    assert pair.attn.poll() is None and after == before, (before, after)
    assert recovered - ffn_up <= 2 * OUTAGE_TIMEOUT_S, f"first exact answer {recovered - ffn_up:.1f}s after the FFN"
    failures = [line for line in tail(pair.attn_log, 200000).splitlines() if "a group did not form at" in line]
    assert len(failures) == 1 and "0644" in failures[0], failures  # logged once however many attempts failed
    with urllib.request.urlopen(f"http://{HOST}:{attn_port}/health", timeout=10) as r:
        assert r.status == 200
    group = _afd_stats(attn_port)["group"]
    assert group["up"] and group["outages"] == 1 and group["reformations"] == 1, group
    _wait_gauge(attn_port, 1.0)

    _stop(pair.attn)  # a clean stop: the FFN server waits for the next group
    pair.start_attention("attention-after-stop.log")
    again = [_token_id(t) for t in _complete(attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]]
    assert again == before and pair.ffn.poll() is None, (before, again)
    assert "AFD FFN rank 0: a group formed" in tail(pair.ffn_log, 50000)
    first_log = tail(first_ffn_log, 50000)
    assert "waiting for its first group" in first_log, first_log[-3000:]
    print(f"FFN killed: {STREAMS} streams ended within {ended_s:.2f}s (timeout_s={OUTAGE_TIMEOUT_S}), a new request "
          f"failed in {new_s:.2f}s; recovery: first successful request {recovered - ffn_up:.2f}s after the restarted "
          f"FFN server was healthy ({recovered - restarted:.1f}s after it was started)")
