"""One formation loop for both sides: a transient fault ends one attempt, never the loop (issue 51, finding 1).

Unit part: a stand-in connector whose ``build`` or ``init`` raises each kind of transient fault seen in the field
(the host name not resolving, the token file too open, a value ``socket.settimeout`` refuses, a bug's
``ValueError``); the loop logs each cause once, counts every failure, backs off, and forms as soon as the fault
is gone; only the stop event ends it, at once.

Real part: an attention side (``AttentionGroup``) and an FFN side (``FfnServer``) with real ``torch_dist``
connectors on loopback, in one process. The FFN server stops (its peer sees the group end), the token file
becomes mode 0644 for a moment, as during a careless rotation, and a new FFN server comes back at once: the
attention side re-forms by itself and exchanges exactly again. Before this loop, the first failed build
killed the re-forming thread ("Exception in thread afd-regroup-0") and the engine never served again.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from afd_patches import metrics
from afd_patches.config import AfdConfig
from afd_patches.connectors.base import ConnectorError, ConnectorTimeout
from afd_patches.models.link import AfdLink
from afd_patches.workers import regroup
from afd_patches.workers.connection import build_connector
from afd_patches.workers.ffn_server import FfnServer
from afd_patches.workers.regroup import AttentionGroup, FormationFailed, FormationLoop
from harness.env import free_port

TIMEOUT_S = 2.0
SLACK_S = 5.0  # a loaded 2-core machine


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pauses of 50 ms doubling to 200 ms: the policy under test, on a test's clock."""
    monkeypatch.setattr(regroup, "RETRY_S", 0.05)
    monkeypatch.setattr(regroup, "RETRY_MAX_S", 0.2)


class _Conn:
    """A connector stand-in: ``init`` raises what ``faults`` hands it, else forms; ``close`` cancels a wait."""

    def __init__(self, fault: BaseException | None, block: bool = False) -> None:
        self.fault = fault
        self.block = block
        self.closed = threading.Event()
        self.messages_sent = self.messages_received = 0

    def init(self, wait_s: float | None = None) -> None:
        if self.block:
            self.closed.wait(30)
            raise ConnectorError("closed while forming")
        if self.fault is not None:
            raise self.fault

    def close(self) -> None:
        self.closed.set()


TRANSIENT: list[BaseException] = [
    socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    ConnectorError("AFD rendezvous at ffn:29611: token file /run/afd/token must not be readable by group or others"),
    ValueError("Timeout value out of range"),
    OverflowError("timestamp too large to convert to C _PyTime_t"),
    PermissionError(13, "Permission denied"),
    ConnectorTimeout("no FFN rank 0 at ffn:29611 within 2s"),
]


@pytest.mark.parametrize("where", ["build", "init"])
def test_every_transient_fault_ends_one_attempt_only(where: str, afd_caplog: pytest.LogCaptureFixture) -> None:
    """Each fault twice in a row, then a good attempt: one formed connector, every failure counted, each cause
    logged at ERROR once."""
    faults = [f for f in TRANSIENT for _ in range(2)]
    built: list[_Conn] = []

    def build() -> _Conn:
        fault = faults.pop(0) if faults else None
        if where == "build" and fault is not None:
            raise fault
        built.append(_Conn(fault if where == "init" else None))
        return built[-1]

    before = metrics.METRICS.counts["group_formation_failures"]
    loop = FormationLoop("AFD attention rank 0", "ffn:29611", build, 60.0, threading.Event())  # type: ignore[arg-type]
    conn = loop.form()
    assert conn is not None and not conn.closed.is_set() and faults == []  # type: ignore[attr-defined]
    assert loop.attempts_failed == 2 * len(TRANSIENT) and loop.failures == 0
    assert metrics.METRICS.counts["group_formation_failures"] - before == 2 * len(TRANSIENT)
    errors = [r.getMessage() for r in afd_caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == len(TRANSIENT), errors  # once per cause
    for fault in TRANSIENT:
        assert sum(str(fault) in e for e in errors) == 1, (fault, errors)
    if where == "init":  # every connector whose attempt failed was closed
        assert all(c.closed.is_set() for c in built[:-1])


def test_only_the_stop_event_ends_the_loop() -> None:
    """A loop whose attempts fail forever keeps trying; setting the stop event and cancelling ends it at once,
    closing the connector whose ``init`` is in progress."""
    stop = threading.Event()
    attempts: list[_Conn] = []

    def build() -> _Conn:
        conn = _Conn(None, block=len(attempts) >= 5) if len(attempts) >= 5 else _Conn(RuntimeError("a bug"))
        attempts.append(conn)
        return conn

    loop = FormationLoop("AFD FFN rank 0", "ffn:29611", build, 60.0, stop)  # type: ignore[arg-type]
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(loop.form()))
    thread.start()
    deadline = time.monotonic() + 10
    while len(attempts) < 6:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    t0 = time.monotonic()
    stop.set()
    loop.cancel()
    thread.join(5)
    assert not thread.is_alive() and out == [None] and time.monotonic() - t0 < 1.0
    assert attempts[-1].closed.is_set()


def test_a_first_group_with_a_deadline_names_the_last_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = FormationLoop("AFD attention rank 0", "ffn:29611", lambda: _Conn(socket.gaierror(-2, "no such host")),  # type: ignore[arg-type,return-value]
                         60.0, threading.Event())
    ticks = itertools.count()
    # the loop's clock advances 0.1 s per reading, so the count of attempts before the deadline does not depend on
    # how loaded the machine is (a CI run once spent the whole 0.5 s in the first attempt)
    monkeypatch.setattr(regroup, "time", SimpleNamespace(monotonic=lambda: next(ticks) * 0.1))
    t0 = time.monotonic()
    with pytest.raises(FormationFailed, match="no such host") as info:
        loop.form(deadline=1.0)
    assert time.monotonic() - t0 < SLACK_S and loop.attempts_failed >= 2
    assert "ffn:29611" in str(info.value) and "attention rank 0" in str(info.value)


# ------------------------------------------------------------------ real connectors on loopback
class _Mlp:
    """The FFN of the test: ``2x + 1`` per row."""

    def afd_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


IDENTITY = {"architecture": "Test", "num_hidden_layers": 2, "hidden_size": 8, "dtype": "float32",
            "max_num_batched_tokens": 64, "exchanges_per_step": 2}


def _exchange(link: AfdLink, step: int) -> None:
    """One step of two layers through the bound connector, each answer checked."""
    conn = link.connector
    assert conn is not None
    for layer in range(2):
        x = torch.full((3, 8), float(step * 10 + layer))
        conn.send_attn_output(x, layer, step)
        assert torch.equal(conn.recv_ffn_output(layer, step), x * 2 + 1)


def _server(cfg: AfdConfig) -> FfnServer:
    server = FfnServer(0, f"{cfg.host}:{cfg.port}", lambda: build_connector(cfg, IDENTITY), 60.0, TIMEOUT_S, _Mlp(),
                       (torch.device("cpu"), torch.float32), None, None)
    server.start()
    return server


def test_the_attention_side_reforms_through_a_token_file_too_open_during_the_ffn_restart(
        tmp_path: Path, afd_caplog: pytest.LogCaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    port = free_port()
    common: dict[str, Any] = {"port": port, "timeout_s": TIMEOUT_S, "token_file": str(token),
                              "connector_extra_config": {"backend": "tcp"}}
    ffn_cfg, attn_cfg = AfdConfig(role="ffn", **common), AfdConfig(role="attention", **common)
    server = _server(ffn_cfg)
    link = AfdLink(2, 8)
    group = AttentionGroup(0, f"127.0.0.1:{port}", lambda: build_connector(attn_cfg, IDENTITY), link, 60.0, TIMEOUT_S,
                           tick=False)
    second: FfnServer | None = None
    try:
        group.start()
        _exchange(link, 0)
        token.chmod(0o644)  # a rotation that left the file readable by others, for a moment
        server.stop()  # the FFN goes away: the next exchange fails, as a step would
        with pytest.raises(ConnectorError) as lost:
            _exchange(link, 1)
        group.lost(lost.value)
        failures = metrics.METRICS.counts["group_formation_failures"]
        deadline = time.monotonic() + 10
        while metrics.METRICS.counts["group_formation_failures"] == failures:
            assert time.monotonic() < deadline, "the re-forming thread made no attempt while the token was open"
            time.sleep(0.02)
        time.sleep(0.5)  # several attempts fail meanwhile
        token.chmod(0o600)
        second = _server(ffn_cfg)
        back = time.monotonic()
        while not group.status().up:
            assert time.monotonic() - back < 2 * TIMEOUT_S + SLACK_S, group.status()
            time.sleep(0.02)
        recovered_s = time.monotonic() - back
        _exchange(link, 2)
        status = group.status().as_json()
        assert status["outages"] == 1 and status["reformations"] == 1, status
        logged = [r.getMessage() for r in afd_caplog.records if r.levelno == logging.ERROR]
        assert sum("group or others" in m or "0644" in m or "permission" in m.lower() for m in logged) == 1, logged
        print(f"re-formed {recovered_s:.2f}s after the FFN was back")
    finally:
        group.stop()
        server.stop()
        if second is not None:
            second.stop()
