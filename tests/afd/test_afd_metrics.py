"""``vllm:afd_*`` metrics: worker snapshots read by the front end's collector, and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from afd_patches import metrics


def _exposition(directory: Path) -> str:
    registry = CollectorRegistry()
    registry.register(metrics.SnapshotCollector(str(directory)))
    return generate_latest(registry).decode()


def test_snapshot_written_by_a_worker_shows_on_the_front_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    monkeypatch.setattr(metrics, "METRICS", metrics.AfdMetrics())
    m = metrics.METRICS
    m.add("exchanges", 6)
    m.add("bytes_sent", 1536)
    m.observe(0.0003)
    m.observe(0.002)
    assert metrics.start_writer("attention", 0)
    deadline = time.monotonic() + 5
    while 'vllm:afd_exchanges_total{rank="0",role="attention"} 6.0' not in (text := _exposition(directory)):
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    assert 'vllm:afd_bytes_sent_total{rank="0",role="attention"} 1536.0' in text
    assert 'vllm:afd_exchange_latency_seconds_bucket{le="0.0005",rank="0",role="attention"} 1.0' in text
    assert 'vllm:afd_exchange_latency_seconds_count{rank="0",role="attention"} 2.0' in text
    for name in metrics.COUNTERS:
        assert f"vllm:afd_{name}_total" in text
    time.sleep(2 * metrics.WRITE_INTERVAL_S)  # nothing changes: the writer blocks (no periodic wake-up) ...
    assert not m.changed.is_set()
    m.add("exchanges")  # ... and the next change wakes it
    while 'vllm:afd_exchanges_total{rank="0",role="attention"} 7.0' not in (text := _exposition(directory)):
        assert time.monotonic() < deadline + 5, text
        time.sleep(0.1)


def test_a_group_state_change_is_written_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other changes wait out ``WRITE_INTERVAL_S`` (here a minute); the group going down or up does not: a request
    that failed for the outage must not find /health (which reads the snapshots) still 200."""
    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(directory))
    monkeypatch.setattr(metrics, "METRICS", metrics.AfdMetrics())
    monkeypatch.setattr(metrics, "WRITE_INTERVAL_S", 60.0)
    metrics.set_group_up(True)
    assert metrics.start_writer("attention", 0)
    deadline = time.monotonic() + 10
    while metrics.attention_groups_down() != []:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    metrics.METRICS.add("exchanges")  # an ordinary change: not written for a minute
    metrics.set_group_up(False)  # ... but this is, at once, with it
    while metrics.attention_groups_down() != [0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert 'vllm:afd_exchanges_total{rank="0",role="attention"} 1.0' in _exposition(directory)


def test_collector_skips_foreign_or_malformed_snapshots(tmp_path: Path) -> None:
    good = {"counts": {"exchanges": 3}, "buckets": [0] * (len(metrics.LATENCY_BUCKETS) + 1), "latency_sum": 0.0,
            "role": "ffn", "rank": 0}
    (tmp_path / "afd-ffn-0-1.json").write_text(json.dumps(good))
    (tmp_path / "afd-bad-1-2.json").write_text("[" * 20000)
    (tmp_path / "afd-neg-1-3.json").write_text(json.dumps({**good, "counts": {"exchanges": -1}, "role": "x"}))
    (tmp_path / "afd-big-1-4.json").write_text(" " * (metrics.MAX_SNAPSHOT_BYTES + 1))
    os.symlink(tmp_path / "afd-ffn-0-1.json", tmp_path / "afd-link-1-5.json")
    text = _exposition(tmp_path)
    lines = [line for line in text.splitlines() if line.startswith("vllm:afd_exchanges_total")]
    assert lines == ['vllm:afd_exchanges_total{rank="0",role="ffn"} 3.0'], text


def test_worker_exports_nothing_without_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(metrics.METRICS_DIR_ENV, raising=False)
    assert not metrics.start_writer("ffn", 0)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(shared))
    assert not metrics.start_writer("ffn", 0)


_FRONT_END = textwrap.dedent("""
    import os, sys
    from afd_patches import metrics
    metrics.export_from_front_end()
    directory = os.environ[metrics.METRICS_DIR_ENV]
    print(directory, flush=True)
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a forked child runs the inherited exit handlers
    os.waitpid(child, 0)
    print(os.path.isdir(directory), flush=True)
""")


def test_the_front_ends_metrics_directory_is_removed_when_it_exits() -> None:
    """The directory lives as long as the process that made it; a forked child's exit leaves it."""
    env = {k: v for k, v in os.environ.items() if k != metrics.METRICS_DIR_ENV}
    out = subprocess.run([sys.executable, "-c", _FRONT_END], capture_output=True, text=True, env=env, timeout=60,
                         check=True).stdout.split()
    assert len(out) == 2 and out[1] == "True", out
    assert os.path.basename(out[0]).startswith("afd-metrics-") and not os.path.exists(out[0]), out


def test_a_stale_snapshot_shows_its_counters_but_no_gauge(tmp_path: Path) -> None:
    """A snapshot its writer marked stale (``<name>.stale``: its last write failed) keeps its counters, loses its
    gauges, and says so in ``vllm:afd_metrics_stale``; a fresh snapshot of the same name wins over a stale one."""
    base = {"buckets": [0] * (len(metrics.LATENCY_BUCKETS) + 1), "latency_sum": 0.0}
    up = {"exchanges": 5, metrics.GROUP_UP: 1, "exchange_span_seconds": 2.0, "exchange_wait_seconds": 1.0}
    (tmp_path / "afd-attention-0-7.json.stale").write_text(json.dumps(
        {**base, "counts": up, "role": "attention", "rank": 0}))
    (tmp_path / "afd-ffn-0-8.json").write_text(json.dumps({**base, "counts": {"exchanges": 4, metrics.GROUP_UP: 1},
                                                           "role": "ffn", "rank": 0}))
    (tmp_path / "afd-ffn-0-8.json.stale").write_text(json.dumps({**base, "counts": {"exchanges": 2,
                                                                                   metrics.GROUP_UP: 0},
                                                                 "role": "ffn", "rank": 0}))
    text = _exposition(tmp_path)
    lines = {line for line in text.splitlines() if line.startswith("vllm:afd_")}
    assert {'vllm:afd_exchanges_total{rank="0",role="attention"} 5.0',
            'vllm:afd_exchanges_total{rank="0",role="ffn"} 4.0',
            'vllm:afd_group_up{rank="0",role="ffn"} 1.0',
            'vllm:afd_metrics_stale{rank="0",role="attention"} 1.0',
            'vllm:afd_metrics_stale{rank="0",role="ffn"} 0.0'} <= lines, text
    assert not [line for line in lines if 'role="attention"' in line and (
        line.startswith(("vllm:afd_group_up", "vllm:afd_ffn_hidden_fraction")))], text
    assert 'vllm:afd_exchanges_total{rank="0",role="ffn"} 2.0' not in lines, text
