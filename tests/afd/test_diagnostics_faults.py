"""Tracing and metrics are best-effort: a write that fails (a file-size limit, a full disk, any ``OSError``) is
logged once per cause, counted, and retried; it never raises into serving, never ends the metrics writer, and
never leaves ``/metrics`` showing a group as up that is down.

The faults are real where the machine allows: ``RLIMIT_FSIZE`` in a child process (``EFBIG`` with ``SIGXFSZ``
ignored, after a short write that stops at the limit), and, as root with ``unshare``, a 64 KiB tmpfs in the
child's own mount namespace (``ENOSPC``). A child reports what it saw as one JSON line; the assertions are here.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import afd_patches
from afd_patches import metrics, trace

REPO = Path(afd_patches.__file__).resolve().parents[1]


def _child(script: str, *args: str, wrap: list[str] | None = None) -> dict[str, Any]:
    """Run ``script`` in a fresh Python (under ``wrap``, a command that ends by running the rest) and return the
    JSON object of its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k not in (trace.DIR_ENV, metrics.METRICS_DIR_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([*(wrap or []), sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    result = json.loads(lines[-1])
    result["stderr"] = done.stderr
    return result


def _assert_whole_lines(path: Path) -> None:
    """The file is ``[`` and then whole events, one per line, each ending in ``,``: nothing partly written."""
    text = path.read_text()
    assert text.endswith("\n"), text[-200:]
    first, *events = text.splitlines()
    assert first == "[" and events, text[:200]
    for line in events:
        assert line.endswith(","), line
        assert json.loads(line[:-1])["ph"] == "X", line


# ------------------------------------------------------------------ tracing
_TRACE_FSIZE = """
    import json, logging, os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    from afd_patches import metrics, trace
    os.environ[trace.DIR_ENV] = sys.argv[1]
    assert trace.TRACER.start("ffn", 0)
    (path,) = [os.path.join(sys.argv[1], n) for n in os.listdir(sys.argv[1])]
    tags = {"microbatch": 0, "step": 1, "tokens": 4}
    trace.TRACER.event("ffn", "ffn", 10.0, 20.0, layer=0, **tags)
    good = os.path.getsize(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (good + 40, hard))  # the next line is cut short at 40 bytes, then EFBIG
    raised = []
    for layer in range(1, 6):
        try:
            trace.TRACER.event("ffn", "ffn", 30.0, 40.0, layer=layer, **tags)
        except OSError as e:
            raised.append(repr(e))
    size_while_full = os.path.getsize(path)
    failures = metrics.METRICS.counts.get("trace_write_failures", 0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # room again
    trace.TRACER.event("ffn", "ffn", 50.0, 60.0, layer=9, **tags)
    print(json.dumps({"raised": raised, "good": good, "size_while_full": size_while_full, "failures": failures,
                      "enabled": trace.TRACER.enabled, "path": path}))
"""


def test_a_trace_write_over_the_file_size_limit_is_counted_and_tracing_resumes(tmp_path: Path) -> None:
    """EFBIG (after a short write): ``event`` does not raise, the cut line is taken back, one warning for five
    failures, each counted; with room again the next event is written and the file reads as before."""
    directory = tmp_path / "trace"
    directory.mkdir(mode=0o700)
    out = _child(_TRACE_FSIZE, str(directory))
    assert out["raised"] == [], out
    assert out["size_while_full"] == out["good"], out  # the 40 bytes of the cut line are gone
    assert out["failures"] == 5 and out["enabled"], out
    assert out["stderr"].count("AFD trace: a write failed") == 1, out["stderr"]
    assert "EFBIG" in out["stderr"], out["stderr"]
    path = Path(out["path"])
    _assert_whole_lines(path)
    assert [e["args"]["layer"] for e in trace.read(directory)] == [0, 9]


class _FlakyWrites:
    """``os.pwrite`` that follows ``script`` call by call, then works: an errno raises it, a ``("cut", n)``
    writes the first ``n`` bytes only (a short write)."""

    def __init__(self, script: list[int | tuple[str, int]]) -> None:
        self.script = script
        self.real = os.pwrite

    def __call__(self, fd: int, data: bytes, offset: int) -> int:
        if not self.script:
            return self.real(fd, data, offset)
        step = self.script.pop(0)
        if isinstance(step, tuple):
            return self.real(fd, data[:step[1]], offset)
        raise OSError(step, os.strerror(step))


def test_no_oserror_leaves_the_tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Any errno, also on the header write of ``start``: logged once per errno, counted, retried by the next
    event (with the header, while it is missing); a record cut short and then failed is taken back."""
    directory = tmp_path / "trace"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(trace.DIR_ENV, str(directory))
    monkeypatch.setattr(metrics, "METRICS", metrics.AfdMetrics())
    # the header fails; event 0 is cut after 5 bytes, then fails; events 1 and 2 fail; event 3 is written
    flaky = _FlakyWrites([errno.ENOSPC, ("cut", 5), errno.EIO, errno.EIO, errno.ENOSPC])
    monkeypatch.setattr(os, "pwrite", flaky)
    tracer = trace.Tracer()
    with caplog.at_level(logging.INFO, logger=afd_patches.LOGGER):
        assert tracer.start("attention", 1)
        for layer in range(4):
            tracer.event("attention", "micro-batch 0", 1.0, 2.0, layer=layer, microbatch=0, step=3)
    assert flaky.script == [] and metrics.METRICS.counts["trace_write_failures"] == 4
    failed = [r.getMessage() for r in caplog.records if "a write failed" in r.getMessage()]
    assert len(failed) == 2 and "ENOSPC" in failed[0] and "EIO" in failed[1], failed
    assert sum("writing again" in r.getMessage() for r in caplog.records) == 1
    (path,) = directory.iterdir()
    _assert_whole_lines(path)
    assert [e["args"]["layer"] for e in trace.read(directory)] == [3]


def test_a_cut_record_that_cannot_be_taken_back_stops_tracing_without_raising(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "trace"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(trace.DIR_ENV, str(directory))
    monkeypatch.setattr(metrics, "METRICS", metrics.AfdMetrics())
    tracer = trace.Tracer()
    assert tracer.start("ffn", 0)
    monkeypatch.setattr(os, "pwrite", _FlakyWrites([("cut", 5), errno.EIO]))

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with caplog.at_level(logging.WARNING, logger=afd_patches.LOGGER):
        tracer.event("ffn", "ffn", 1.0, 2.0, layer=0, microbatch=0, step=0)
        tracer.event("ffn", "ffn", 3.0, 4.0, layer=1, microbatch=0, step=0)
    assert not tracer.enabled and metrics.METRICS.counts["trace_write_failures"] == 1
    assert any("tracing stops" in r.getMessage() for r in caplog.records), caplog.text


def test_the_snapshot_writer_survives_any_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only ``OSError``: a snapshot taken while another thread adds a key can raise ``RuntimeError``. The
    write reports failure, marks the last snapshot stale and counts; the next write works and clears the mark."""
    monkeypatch.setattr(metrics, "METRICS", metrics.AfdMetrics())
    path = tmp_path / "afd-ffn-0-1.json"
    snapshots = metrics._SnapshotFile(str(path), "ffn", 0)
    metrics.set_group_up(True)
    assert snapshots.write() and path.exists()
    real = metrics.METRICS.snapshot

    def racing() -> dict[str, Any]:
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(metrics.METRICS, "snapshot", racing)
    assert not snapshots.write()
    assert not path.exists() and Path(f"{path}{metrics.STALE_SUFFIX}").exists()
    assert metrics.METRICS.counts["metrics_write_failures"] == 1
    monkeypatch.setattr(metrics.METRICS, "snapshot", real)
    assert snapshots.write()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert json.loads(path.read_text())["counts"]["metrics_write_failures"] == 1


def test_a_bad_event_limit_does_not_stop_the_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``AFD_TRACE_MAX_EVENTS`` that is not a number: the default is used, ``start`` does not raise."""
    directory = tmp_path / "trace"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(trace.DIR_ENV, str(directory))
    monkeypatch.setenv(trace.MAX_EVENTS_ENV, "lots")
    tracer = trace.Tracer()
    assert tracer.start("ffn", 0)
    tracer.event("ffn", "ffn", 1.0, 2.0, layer=0, microbatch=0, step=0)
    assert len(trace.read(directory)) == 1


# ------------------------------------------------------------------ metrics
_METRICS_FAULT = """
    import json, os, resource, signal, sys, threading, time
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from prometheus_client import CollectorRegistry, generate_latest
    from afd_patches import metrics
    directory, fault = sys.argv[1], sys.argv[2]
    os.environ[metrics.METRICS_DIR_ENV] = directory
    metrics.WRITE_INTERVAL_S = 0.05
    metrics.MAX_BACKOFF_S = 0.4
    UP, DOWN = 'vllm:afd_group_up{rank="0",role="ffn"} 1.0', 'vllm:afd_group_up{rank="0",role="ffn"} 0.0'
    STALE = 'vllm:afd_metrics_stale{rank="0",role="ffn"} 1.0'
    FRESH = 'vllm:afd_metrics_stale{rank="0",role="ffn"} 0.0'

    def scrape():
        registry = CollectorRegistry()
        registry.register(metrics.SnapshotCollector(directory))
        return generate_latest(registry).decode()

    def writer_alive():
        return any(t.name == "afd-metrics" for t in threading.enumerate())

    def until(ok, what):
        deadline = time.monotonic() + 60
        while not ok():
            if time.monotonic() > deadline:
                print(json.dumps({"timeout": what, "text": scrape(), "alive": writer_alive()}))
                sys.exit(0)
            time.sleep(0.02)

    metrics.set_group_up(True)
    assert metrics.start_writer("ffn", 0)
    until(lambda: UP in scrape(), "up")
    if fault == "fsize":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
    else:  # a full tmpfs: fill it
        filler = os.path.join(os.path.dirname(directory), "filler")
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"x" * 4096)
            except OSError:
                pass
    metrics.set_group_up(False)  # the group goes down; the writer cannot say so
    failures = lambda: metrics.METRICS.counts.get("metrics_write_failures", 0)
    until(lambda: failures() >= 1 or not writer_alive(), "a failed write")
    after_first = scrape()
    until(lambda: failures() >= 3 or not writer_alive(), "retries")
    while_down = scrape()
    alive_while_down = writer_alive()
    if fault == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    else:
        os.unlink(filler)
    until(lambda: DOWN in scrape() and FRESH in scrape() or not writer_alive(), "resumed")
    print(json.dumps({"after_first": after_first, "while_down": while_down, "alive_while_down": alive_while_down,
                      "resumed": scrape(), "alive": writer_alive(), "files": sorted(os.listdir(directory)),
                      "UP": UP, "STALE": STALE}))
"""


def _assert_metrics_fault_handled(out: dict[str, Any]) -> None:
    assert "timeout" not in out, out
    for text in (out["after_first"], out["while_down"]):  # the stale snapshot's up=1 is never shown
        assert out["UP"] not in text and out["STALE"] in text, text
        assert 'vllm:afd_exchanges_total{rank="0",role="ffn"}' in text, text  # its counters are still shown
    assert out["alive_while_down"] and out["alive"], out
    resumed = out["resumed"]
    failures = [line for line in resumed.splitlines()
                if line.startswith('vllm:afd_metrics_write_failures_total{rank="0",role="ffn"}')]
    assert failures and float(failures[0].split()[-1]) >= 3, resumed
    assert len([f for f in out["files"] if f.startswith("afd-")]) == 1 and all(
        f.endswith(".json") for f in out["files"]), out["files"]  # no stale mark, no temporary file left
    assert out["stderr"].count("AFD metrics: a snapshot write failed") == 1, out["stderr"]


def test_the_metrics_writer_survives_a_file_size_limit_and_never_shows_a_stale_up(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir(mode=0o700)
    _assert_metrics_fault_handled(_child(_METRICS_FAULT, str(directory), "fsize"))


def _private_tmpfs_problem() -> str | None:
    """Why a private 64 KiB tmpfs cannot be mounted here (None: it can)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (util-linux)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare -m + mount failed: {probe.stderr.decode()[-300:]}"


_IN_TMPFS = 'mount --make-rprivate / && mount -t tmpfs -o size=64k,mode=0700 tmpfs "$0" && exec "$@"'


def test_diagnostics_on_a_full_disk(tmp_path: Path) -> None:
    """A full 64 KiB tmpfs, in a mount namespace of the child's own (gone with it): the metrics writer as above;
    the tracer counts ENOSPC, does not raise, and writes again once the filler is removed. Fails (never skips)
    where such a mount cannot be made: CI runs as root, as the fault tests here do."""
    problem = _private_tmpfs_problem()
    assert problem is None, problem
    mount = tmp_path / "small"
    mount.mkdir()
    wrap = ["unshare", "-m", "sh", "-c", _IN_TMPFS, str(mount)]
    _assert_metrics_fault_handled(_child(
        "import os, sys; os.mkdir(sys.argv[1], 0o700)\n" + textwrap.dedent(_METRICS_FAULT),
        str(mount / "m"), "full", wrap=wrap))
    out = _child(_TRACE_FULL, str(mount / "t"), str(tmp_path / "copy.json"), wrap=wrap)
    assert out["raised"] == [] and out["failures"] >= 1, out
    assert "ENOSPC" in out["stderr"], out["stderr"]
    copy = tmp_path / "copy"
    copy.mkdir()
    (tmp_path / "copy.json").rename(copy / "afd-trace-ffn-0-1.json")
    _assert_whole_lines(copy / "afd-trace-ffn-0-1.json")
    layers = [e["args"]["layer"] for e in trace.read(copy)]  # 0, those that fitted in its last page, 100
    assert layers == [*range(len(layers) - 1), 100] and len(layers) - 2 + out["failures"] == 59, layers
    assert not any(mount.iterdir())  # the tmpfs went with the child's namespace


_TRACE_FULL = """
    import json, logging, os, shutil, sys
    logging.basicConfig(level=logging.INFO)
    from afd_patches import metrics, trace
    os.mkdir(sys.argv[1], 0o700)
    os.environ[trace.DIR_ENV] = sys.argv[1]
    assert trace.TRACER.start("ffn", 0)
    (path,) = [os.path.join(sys.argv[1], n) for n in os.listdir(sys.argv[1])]
    tags = {"microbatch": 0, "step": 1, "tokens": 4}
    trace.TRACER.event("ffn", "ffn", 10.0, 20.0, layer=0, **tags)
    filler = os.path.join(os.path.dirname(sys.argv[1]), "filler")
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"x" * 100)
        except OSError:
            pass
    raised = []
    for layer in range(1, 60):  # some of these fit in the file's last page, then ENOSPC
        try:
            trace.TRACER.event("ffn", "ffn", 30.0, 40.0, layer=layer, **tags)
        except OSError as e:
            raised.append(repr(e))
    failures = metrics.METRICS.counts.get("trace_write_failures", 0)
    os.unlink(filler)
    trace.TRACER.event("ffn", "ffn", 50.0, 60.0, layer=100, **tags)
    shutil.copyfile(path, sys.argv[2])
    print(json.dumps({"raised": raised, "failures": failures}))
"""
