"""AFD across (simulated) hosts behind vLLM's OpenAI server: a token, strangers, a rolling restart, metrics.

One FFN server (rendezvous on 127.0.0.2, with ``AFD_TOKEN``) and one attention server
(joining from 127.0.0.1), real vLLM CPU build, tiny float32 Llama:

1. an FFN server whose ``--afd-host`` is not loopback and that has no token fails fast,
   naming ``AFD_TOKEN``/``token_file`` (its command line checked at vLLM's config step, in the session's one
   probe process: ``front_end``);
2. the rendezvous port answers on 127.0.0.2 only (127.0.0.3 is refused);
3. a scanner (``tests/support/afd_probe.py``) probes the running FFN server; then the attention
   server joins within its normal start time and its greedy tokens and top-5 logprobs equal
   plain vLLM's; the FFN log names each refused probe once;
4. the attention server's ``/metrics`` shows ``vllm:afd_exchanges`` grown by layers × steps
   for that request;
5. the attention server is stopped (SIGTERM); a bounded hypothesis fuzz hits the FFN server's
   rendezvous while it waits for a new group; the attention server is started again and the
   same request gives the same token ids; the FFN server's pid never changed and its
   ``/metrics`` counts one group re-formation.

Marked ``vllm``: three server starts (about 2–3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.config_probe import Probe
from harness.engine import tail
from harness.env import free_port
from tests.integration.test_afd_server import (
    HOST,
    MAX_TOKENS,
    SERVER,
    START_TIMEOUT_S,
    _complete,
    _max_logprob_difference,
    _server_args,
    _servers,
    _start,
    _stop,
    _token_id,
    _wait_healthy,
)
from tests.support import afd_probe

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 5: the session's front-end probe (its
# non-loopback case) when this module's tests come first, the session's plain engine (plain_generation), FFN +
# attention + restarted attention servers.
ENGINE_BUDGET = 5

FFN_HOST = "127.0.0.2"
TOKEN = "a17d9c828ccd116fb19ede0e32d5017725d1eaf6b192028ac03f21edc889fe73"  # secrets.token_hex(32)
LAYERS = 2  # tiny_model's Llama
FUZZ_S = 15.0
FAIL_FAST_S = 90.0  # a front end that refuses its config: vLLM's imports, then the error


def _metric(port: int, name: str, role: str) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    prefix = f'{name}{{rank="0",role="{role}"}} '
    values = [float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]
    assert len(values) == 1, f"{prefix!r} not in /metrics:\n{text[-3000:]}"
    return values[0]


def _wait_metric(port: int, name: str, role: str, want: float, timeout_s: float = 10.0) -> float:
    """Poll ``/metrics`` until ``name`` equals ``want`` (worker snapshots arrive up to 0.5 s late)."""
    deadline = time.monotonic() + timeout_s
    while (value := _metric(port, name, role)) != want and time.monotonic() < deadline:
        time.sleep(0.25)
    return value


def _tokens(response: dict) -> list[int]:
    return [_token_id(t) for t in response["choices"][0]["logprobs"]["tokens"]]


def front_end_cases(model: Path) -> list[dict[str, object]]:
    """For the session's probe process (``front_end``, ``AFD_TOKEN`` unset): an FFN server's command line whose
    ``--afd-host`` is not loopback, without a token."""
    args = _server_args(model, free_port(), "--afd-role", "ffn", "--afd-host", "10.1.2.3",
                        "--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]}))
    return [{"name": "non-loopback-host-without-token", "cli": args[len(SERVER):]}]


def test_non_loopback_host_without_token_fails_fast(front_end: Probe) -> None:
    """Refused at the server's config step (``create_engine_config()``), naming ``AFD_TOKEN``/``token_file``."""
    result = front_end.results["non-loopback-host-without-token"]
    assert result["refused"], result
    out = result["error"]
    assert "AFD_TOKEN" in out and "token_file" in out and '["host"]' in out, out[-3000:]
    assert result["seconds"] < FAIL_FAST_S, result["seconds"]
    print(f"non-loopback host without a token: refused in {result['seconds']:.1f}s of its config step")


def test_token_scanner_rolling_restart_and_metrics(model_dir: Path, plain_generation: Any, tmp_path: Path) -> None:
    plain = plain_generation
    afd_port, ffn_port, attn_port = free_port(), free_port(), free_port()
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = [*arch, "--afd-port", str(afd_port), "--afd-host", FFN_HOST, "--afd-timeout-s", "300"]
    with _servers() as procs:
        ffn_log = tmp_path / "ffn.log"
        ffn = _start(procs, _server_args(model_dir, ffn_port, "--afd-role", "ffn", *common), ffn_log,
                     AFD_TOKEN=TOKEN)
        afd_probe.wait_listening(FFN_HOST, afd_port, START_TIMEOUT_S,
                                 lambda: None if ffn.poll() is None else tail(ffn_log))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.3", afd_port), timeout=5)
        got, idle = afd_probe.scan(FFN_HOST, afd_port, TOKEN)
        _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)

        attn_args = _server_args(model_dir, attn_port, "--afd-role", "attention", *common)
        attn_log = tmp_path / "attention.log"
        attn = _start(procs, attn_args, attn_log, AFD_TOKEN=TOKEN)
        attn_s = _wait_healthy(attn, attn_port, attn_log, START_TIMEOUT_S)
        for s in idle:
            s.close()
        scan_log = ffn_log.read_text(errors="replace").splitlines()  # the fuzz below adds more refusals
        before = _wait_metric(attn_port, "vllm:afd_exchanges_total", "attention", -1.0, 1.0)
        first = _complete(attn_port, model_dir)
        after = _wait_metric(attn_port, "vllm:afd_exchanges_total", "attention", before + LAYERS * MAX_TOKENS)

        _stop(attn)
        procs.remove(attn)
        connections = afd_probe.fuzz(FFN_HOST, afd_port, FUZZ_S)
        attn_log2 = tmp_path / "attention2.log"
        attn2 = _start(procs, attn_args, attn_log2, AFD_TOKEN=TOKEN)
        attn2_s = _wait_healthy(attn2, attn_port, attn_log2, START_TIMEOUT_S)
        second = _complete(attn_port, model_dir)
        assert ffn.poll() is None, f"FFN server died:\n{tail(ffn_log)}"
        reformed = _wait_metric(ffn_port, "vllm:afd_group_reformations_total", "ffn", 1.0)
        refused = _metric(ffn_port, "vllm:afd_handshakes_refused_total", "ffn")
        ffn_pid = ffn.pid
        assert procs[0] is ffn and ffn.poll() is None

    tokens = _tokens(first)
    assert tokens == plain.result["tokens"][0], f"AFD {tokens} != plain vLLM {plain.result['tokens'][0]}"
    worst = _max_logprob_difference(plain.result["logprobs"][0], first["choices"][0]["logprobs"]["top_logprobs"])
    assert worst == 0.0, worst
    assert _tokens(second) == tokens, "the restarted attention server answered differently"
    assert after - before == LAYERS * MAX_TOKENS, (before, after)
    assert reformed == 1.0
    assert 0 < connections <= 2000
    assert refused >= afd_probe.SCAN_PROBES + afd_probe.IDLE_CONNECTIONS + connections * 0.5, (refused, connections)
    afd_probe.check_scan(got, scan_log)
    assert ffn.pid == ffn_pid
    print(f"attention joined after the scanner in {attn_s:.1f}s, again after the restart in {attn2_s:.1f}s; "
          f"tokens {tokens} equal plain vLLM (max |dlogprob| {worst:.1e}); exchanges +{after - before:g}; "
          f"fuzz {connections} connections; FFN refused {refused:g}; FFN pid {ffn_pid} kept; "
          f"{os.cpu_count()} cpus")
