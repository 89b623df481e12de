"""The parts of the delayed-link benchmark (issue 49): the delay relay and the ping-pong cost model."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import pingpong_model as pm
from harness.delay_link import DelayLink, RelayProcess, echo_server, relay_cost, round_trip


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An echo server on loopback: what the relay is put in front of."""
    with echo_server() as address:
        yield address


def test_the_relay_holds_each_byte_the_delay_each_way_and_keeps_order(echo: tuple[str, int]) -> None:
    link = DelayLink(echo, 0.200)
    try:
        with socket.create_connection(("127.0.0.1", link.port)) as sock:
            assert round_trip(sock, b"a" * 100) >= 0.400  # 200 ms up, 200 ms down
            link.delay_s = 0.0
            assert round_trip(sock, b"b" * 100) < 0.400  # (bounds far apart: CI's cores are busy)
        chunks, least = link.stats()
        assert chunks >= 4 and least == 0.0
    finally:
        link.close()


def test_the_sender_is_not_blocked_and_messages_are_in_flight_together(echo: tuple[str, int]) -> None:
    """Ten messages sent back to back through a 250 ms link come back after about one round trip, not ten."""
    link = DelayLink(echo, 0.250)
    try:
        with socket.create_connection(("127.0.0.1", link.port)) as sock:
            start = time.monotonic()
            for i in range(10):
                sock.sendall(bytes([i]) * 10)
            assert time.monotonic() - start < 0.250  # every send returned before the first could arrive
            got = b""
            while len(got) < 100:
                got += sock.recv(65536)
            took = time.monotonic() - start
        assert got == b"".join(bytes([i]) * 10 for i in range(10))  # in order
        assert 0.500 <= took < 2.500  # one round trip, not ten (5 s)
    finally:
        link.close()


def test_the_relay_process_changes_its_delay_while_connected(echo: tuple[str, int]) -> None:
    relay = RelayProcess(echo, 0.0)
    try:
        with socket.create_connection(("127.0.0.1", relay.port)) as sock:
            relay.set_delay(0.300)
            assert round_trip(sock, b"y" * 64) >= 0.600
            relay.set_delay(0.0)
            assert round_trip(sock, b"x" * 64) < 0.600
    finally:
        relay.stop()
    assert relay.proc.returncode == 0


def _calibration(attention: float, ffn: float, latency: float = 0.0, overhead: float = 0.0,
                 layers: int = 4) -> pm.Calibration:
    """Costs proportional to the batch size (per token: ``attention``, ``ffn``), fixed latency and overhead."""
    return pm.Calibration(layers, {b: pm.Costs(attention * b, ffn * b, latency, overhead) for b in (1, 64)})


def test_one_micro_batch_is_the_sum_of_its_parts() -> None:
    cal = _calibration(1e-4, 2e-4, latency=1e-4, overhead=1e-3)
    step = pm.step_seconds(cal, 16, 1, 0.001)
    assert step == pytest.approx(1e-3 + 4 * (16e-4 + 32e-4 + 1e-4 + 2e-3))


def test_enough_micro_batches_hide_the_link_and_the_model_names_them() -> None:
    """Attention and FFN of equal cost: the cycle is bound by one micro-batch's round trip until N·a covers it."""
    cal = _calibration(1e-4, 1e-4)  # 16 tokens: a = f = 1.6 ms per layer unsplit
    no_link = pm.step_seconds(cal, 16, 1, 0.0)
    assert no_link == pytest.approx(4 * 3.2e-3)
    # at N = 4 each micro-batch is 0.4 ms on each side; a 1 ms link: cycle max(1.6, 1.6, 0.4 + 2 + 0.4) = 2.8 ms
    assert pm.step_seconds(cal, 16, 4, 0.001) < no_link
    assert pm.best_n(cal, 16, 0.0) > 1  # overlap pays even with no delay
    assert pm.best_n(cal, 16, 0.002) == 4
    assert pm.throughput(cal, 16, 4, 0.002) < pm.throughput(cal, 16, 4, 0.0)


def test_handover_and_split_costs_count_only_for_split_steps() -> None:
    cal = pm.Calibration(2, {1: pm.Costs(1e-4, 1e-4, 0.0, 0.0), 64: pm.Costs(64e-4, 64e-4, 0.0, 0.0)},
                         handover_s=1e-3, split_s=5e-3)
    assert pm.step_seconds(cal, 8, 1, 0.0) == pytest.approx(2 * 16e-4)
    assert pm.step_seconds(cal, 8, 2, 0.0) > pm.step_seconds(cal, 8, 1, 0.0) + 5e-3


def test_split_is_even_and_never_empty() -> None:
    assert pm.split(16, 3) == [6, 5, 5]
    assert pm.split(2, 4) == [1, 1]
    assert sum(pm.split(64, 4)) == 64


def _event(name: str, tid: str, ts: float, dur: float, step: int, layer: int, k: int = 0,
           tokens: int | None = None) -> dict[str, object]:
    args: dict[str, object] = {"step": step, "layer": layer, "microbatch": k}
    if tokens is not None:
        args["tokens"] = tokens
    return {"name": name, "ph": "X", "pid": "p", "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(tokens: int, micro_batches: int, steps: int, first_step: int = 1) -> list[dict[str, object]]:
    """A synthetic trace: per layer and micro-batch attention 100 µs + send 10 µs (each micro-batch at N > 1 30 µs
    more), FFN 200 + 20 µs, wait 400 µs at N = 1; steps 1 ms apart (N > 1: 1.5 ms)."""
    events = []
    t = 0.0
    for step in range(first_step, first_step + steps):
        begin = t
        for layer in range(2):
            for k in range(micro_batches):
                extra = 30.0 if micro_batches > 1 else 0.0
                events += [_event("attention", f"micro-batch {k}", t, 100 + extra, step, layer, k),
                           _event("send", f"micro-batch {k}", t + 100 + extra, 10, step, layer, k),
                           _event("ffn", "ffn", t + 120, 200, step, layer, k, tokens // micro_batches),
                           _event("send", "ffn", t + 320, 20, step, layer, k, tokens // micro_batches),
                           _event("wait", f"micro-batch {k}", t + 110 + extra, 400, step, layer, k)]
                t += 510 + extra
        t += 1000 if micro_batches == 1 else 1500
        assert t > begin
    return events


def test_the_calibration_reads_the_costs_from_a_trace() -> None:
    n1 = _trace(8, 1, 6) + _trace(16, 1, 6, first_step=100)
    n2 = _trace(16, 2, 6)
    cal = pm.calibrate(n1, n2)
    assert cal.layers == 2
    costs = cal.points[16]
    assert costs.attention_s == pytest.approx(110e-6)
    assert costs.ffn_s == pytest.approx(220e-6)
    assert costs.latency_s == pytest.approx(180e-6)
    assert costs.overhead_s == pytest.approx(1000e-6)
    assert sorted(cal.points) == [8, 16]
    assert cal.handover_s == pytest.approx(30e-6)
    assert cal.split_s == pytest.approx(500e-6)


def test_a_trace_without_two_batch_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="1 batch size"):
        pm.calibrate(_trace(8, 1, 6), [])


def test_the_relay_cost_is_measured_against_the_direct_round_trip() -> None:
    cost = relay_cost([0.0, 0.020], pings=20)  # medians of 20 round trips
    assert cost[-1] > 0 and cost[0.020] >= 0.015 and cost[0.020] > cost[0.0]


def test_the_report_and_the_plot_of_a_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's report over a made-up grid: figures against N = 1 at D = 0, the model's error and pick."""
    from benchmarks import afd_link_delay as bench

    args = argparse.Namespace(requests=16, tokens=64, delays=[0.0, 1.0], micro_batches=[1, 2])
    cal = _calibration(1e-4, 1e-4, latency=1e-4)
    rates = {(1, 0.0): 100.0, (2, 0.0): 110.0, (1, 1.0): 50.0, (2, 1.0): 80.0}
    cells = {(n, d, 16): bench.Cell([r, r]) for (n, d), r in rates.items()}
    run = bench.ModelRun("m", cells, cal, 1.0)
    figures = {f.key: f for f in bench.report(run, args, {-1.0: 1e-4, 0.0: 5e-5, 0.001: 0.00105})}
    assert figures["m_d1_best"].value == pytest.approx(0.8) and "best N 2" in figures["m_d1_best"].detail
    assert figures["m_d0_best"].value == pytest.approx(1.1)
    assert figures["m_model_pick"].value <= 1.0 and "m_model_error" in figures
    assert "model" in capsys.readouterr().out
    bench.plot([run], args, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"


def test_the_model_runs_on_a_users_own_trace_folders(tmp_path: Path) -> None:
    """``python -m benchmarks.pingpong_model TRACE_N1 TRACE_N2`` (docs/running.md, "Choosing micro_batches")."""
    import json
    import subprocess
    import sys

    from harness.env import REPO

    for name, events in (("n1", _trace(8, 1, 6) + _trace(16, 1, 6, first_step=100)), ("n2", _trace(16, 2, 6))):
        (tmp_path / name).mkdir()
        lines = "".join(json.dumps(e) + ",\n" for e in events)
        (tmp_path / name / "afd-trace-attention-0-1.json").write_text("[\n" + lines)
    run = subprocess.run([sys.executable, "-m", "benchmarks.pingpong_model", str(tmp_path / "n1"),
                          str(tmp_path / "n2"), "--tokens", "16", "--delay-ms", "1"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert '"layers": 2' in run.stdout and "D = 1 ms, 16 tokens per step: N=1" in run.stdout
    assert "best N = " in run.stdout
