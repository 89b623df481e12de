"""AFD counters of one process, exported as ``vllm:afd_*`` metrics on the API server's ``/metrics``.

Counting
    ``METRICS`` is this process's ``AfdMetrics``; connectors and role workers
    add to it (plain integer/float updates, no lock: each field has one
    writer thread, and a scrape that sees a half-updated histogram is off by
    one exchange at most).

Export
    The connector runs in vLLM's worker process, the ``/metrics`` endpoint in
    the API server process, whose Prometheus registry is in-process (one API
    server). So the API server, when it starts an AFD engine
    (``export_from_front_end``, called by the ``--afd-*`` flag handling),
    creates a private directory (mode 0700), names it in ``AFD_METRICS_DIR``
    for the engine processes it spawns, and registers a collector that reads
    the snapshots found there at scrape time; the directory is removed when
    that process exits (not after a SIGKILL). A worker (``start_writer``)
    writes its snapshot there (JSON, atomically) at most every
    ``WRITE_INTERVAL_S`` while it changes, and at once when its group goes
    down or up (``set_group_up``: ``/health`` and ``vllm:afd_group_up`` read
    it; a request that failed for the outage must not find ``/health`` 200).
    Snapshots are data: each is opened without following links, must be a
    regular file of this user, at most ``MAX_SNAPSHOT_BYTES``, and only known
    numeric fields are read; anything else is skipped. While nothing changes the writer blocks (no periodic
    wake-up on an idle engine).

Failures (best-effort, like tracing)
    A snapshot the writer cannot write (any exception: ``ENOSPC``, ``EFBIG``,
    the directory gone) is logged once per cause, counted in
    ``vllm:afd_metrics_write_failures``, and retried after a backoff that
    doubles from ``WRITE_INTERVAL_S`` up to ``MAX_BACKOFF_S``, whether or not
    the counters change meanwhile; the thread lives as long as the process.
    Before retrying, the writer renames its last snapshot to
    ``<name>.stale`` (a rename needs no free blocks; if it fails, the file is
    removed), so the value it could not replace is never read as current:
    the collector shows a stale snapshot's counters (its last values, lower
    bounds of the true ones) but none of its gauges (no
    ``vllm:afd_group_up`` from a file that may say 1 of a group that is
    down), and ``vllm:afd_metrics_stale`` is 1 for that rank. The first
    snapshot written again replaces the mark (a fresh file wins over a stale
    one of the same name) and one line is logged. ``FailureLog`` is that
    logging and counting; ``afd_patches.trace`` uses it too.

Metrics (labels ``role``, ``rank``)
    ``vllm:afd_exchanges`` (attention: layer exchanges answered; FFN: batched
    layer calls served), ``vllm:afd_exchange_latency_seconds`` (histogram;
    attention: send to answer; FFN: inputs received to outputs ready to send),
    ``vllm:afd_bytes_sent`` / ``vllm:afd_bytes_received`` (tensor payloads),
    ``vllm:afd_idle_steps`` (zero-token steps), ``vllm:afd_handshakes_accepted``
    / ``vllm:afd_handshakes_refused`` (rendezvous connections),
    ``vllm:afd_group_reformations`` (groups formed after the first), and on the
    attention role ``vllm:afd_steps``, ``vllm:afd_micro_batches`` (their ratio is
    the mean micro-batch count per step), ``vllm:afd_replayed_steps`` and the
    histogram ``vllm:afd_hold_seconds`` (steps held while the FFN was lost, and
    how long: ``afd_patches.workers.regroup``), ``vllm:afd_exchange_span_seconds`` and
    ``vllm:afd_exchange_wait_seconds``, with the gauge ``vllm:afd_ffn_hidden_fraction``
    (``1 - wait / span``: how much of the FFN's round trips overlapped attention).
    Counters get Prometheus' ``_total`` suffix on the wire. One gauge,
    ``vllm:afd_group_up`` (``set_group_up``): 1 while this rank's group is formed,
    0 while it waits for one (attention: from the loss of its FFN until the group
    re-forms; FFN: while it waits for a group, the first one included); a value
    other than 0 or 1 in a snapshot is skipped. ``vllm:afd_metrics_stale``:
    0 while the rank's snapshot is current, 1 while its writer cannot write
    (see Failures). Best-effort diagnostics count their own failures:
    ``vllm:afd_trace_write_failures`` (``afd_patches.trace``) and
    ``vllm:afd_metrics_write_failures``.

Limits
    Offline engines (``LLM(...)``) export nothing; their counters are in
    ``afd_stats()``. Values appear on ``/metrics`` up to ``WRITE_INTERVAL_S``
    late (the group gauge: the time of one write). A rank whose very first
    snapshot fails is absent from ``/metrics`` (there is nothing to mark stale) until a write succeeds; a
    stale mark that can be neither made nor the old file removed (a file
    system gone read-only) leaves the old snapshot readable, and says so in
    the log once. A worker that dies leaves its snapshot as it was.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from afd_patches import LOGGER

logger = logging.getLogger(LOGGER)

METRICS_DIR_ENV = "AFD_METRICS_DIR"
WRITE_INTERVAL_S = 0.5
MAX_BACKOFF_S = 10.0  # the longest wait between two tries of a snapshot that could not be written
STALE_SUFFIX = ".stale"  # appended to a snapshot's name by its writer when a write fails
MAX_SNAPSHOT_BYTES = 64 * 1024
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
HOLD_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class Histogram:
    """One histogram of the snapshot: its help, its upper bounds (+Inf added) and its keys in a snapshot."""

    doc: str
    bounds: tuple[float, ...]
    buckets_key: str
    sum_key: str


HISTOGRAMS = {
    "exchange_latency_seconds": Histogram("Time of one AFD layer exchange.", LATENCY_BUCKETS, "buckets",
                                          "latency_sum"),
    "hold_seconds": Histogram("Attention role: how long a step whose FFN was lost was held, until it ran again "
                              "or failed (hold_s).", HOLD_BUCKETS, "hold_buckets", "hold_sum"),
}
COUNTERS = {
    "exchanges": "AFD layer exchanges (attention: answered; FFN: batched layer calls served).",
    "bytes_sent": "Bytes of tensor payload sent to the other role.",
    "bytes_received": "Bytes of tensor payload received from the other role.",
    "idle_steps": "Zero-token steps (idle attention ranks kept in step).",
    "handshakes_accepted": "Rendezvous handshakes that authenticated and joined a group.",
    "handshakes_refused": "Rendezvous connections refused (malformed, unauthenticated, slow, duplicate).",
    "group_reformations": "AFD groups formed after the first (attention engines restarted).",
    "group_formation_failures": "Group formation attempts that failed (any cause: a peer missing, refused or "
                                "mismatched, the token file or host name unusable for a moment); each is retried.",
    "steps": "Forward steps of the attention model (attention role).",
    "micro_batches": "Micro-batches those steps ran in (a step not split counts 1); divided by steps: the mean "
                     "micro-batch count per step.",
    "exchange_span_seconds": "Attention role: summed time from sending a layer's hidden states to having the "
                             "FFN's answer (FFN compute, transfer, and whatever ran meanwhile).",
    "exchange_wait_seconds": "Attention role: the part of exchange_span_seconds spent blocked waiting for the "
                             "answer (not hidden behind another micro-batch's attention).",
    "replayed_steps": "Attention role: steps held while their FFN was lost and run again, from their first layer, "
                      "once the group re-formed (hold_s).",
    "trace_write_failures": "Trace events not written because the write failed (AFD_TRACE_DIR on a full disk, "
                            "a file-size limit); each later event tries again.",
    "metrics_write_failures": "Metrics snapshots this process failed to write; retried with backoff, and "
                              "vllm:afd_metrics_stale is 1 meanwhile.",
}
HIDDEN = "ffn_hidden_fraction"
STALE = "metrics_stale"
STALE_DOC = ("1 while this AFD rank's metrics writer cannot write (its counters are the last it wrote, its gauges are "
             "left out), 0 while its snapshot is current.")
HIDDEN_DOC = ("Attention role: 1 - exchange_wait_seconds / exchange_span_seconds, the fraction of the exchange "
              "round trips (FFN compute and transfer) that overlapped attention compute of another micro-batch.")


class AfdMetrics:
    """The counters and histograms (``HISTOGRAMS``) of this process."""

    def __init__(self) -> None:
        self.changed = threading.Event()  # set by every update; the writer sleeps on it while nothing changes
        self.urgent = threading.Event()  # set when the group state changes: written without the interval's wait
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.histograms = {name: [0] * (len(h.bounds) + 1) for name, h in HISTOGRAMS.items()}  # last: +Inf
        self.sums = dict.fromkeys(HISTOGRAMS, 0.0)

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        if not self.changed.is_set():
            self.changed.set()

    def observe(self, seconds: float, histogram: str = "exchange_latency_seconds") -> None:
        """One observation of ``histogram`` (by default: an exchange that took ``seconds``)."""
        self.histograms[histogram][bisect.bisect_left(HISTOGRAMS[histogram].bounds, seconds)] += 1
        self.sums[histogram] += seconds
        if not self.changed.is_set():
            self.changed.set()

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"counts": dict(self.counts)}
        for name, h in HISTOGRAMS.items():
            snap[h.buckets_key], snap[h.sum_key] = list(self.histograms[name]), self.sums[name]
        return snap

    def exchanged(self, sent_at: float, waited_at: float, answered_at: float) -> None:
        """One attention-side exchange: sent at ``sent_at``, waited for from ``waited_at``, answered at
        ``answered_at`` (``time.perf_counter()`` values)."""
        self.counts["exchange_span_seconds"] += answered_at - sent_at
        self.counts["exchange_wait_seconds"] += answered_at - waited_at
        if not self.changed.is_set():
            self.changed.set()


METRICS = AfdMetrics()
GROUP_UP = "group_up"  # the gauge's key in a snapshot's counts
GROUP_UP_DOC = "1 while this AFD rank's group is formed, 0 while it waits for one (FFN lost, or no attention rank yet)."


def set_group_up(up: bool) -> None:
    """Record this process's group state (``vllm:afd_group_up``) for the next snapshot."""
    if METRICS.counts.get(GROUP_UP) != int(up):
        METRICS.urgent.set()
    METRICS.counts[GROUP_UP] = int(up)
    METRICS.changed.set()


class FailureLog:
    """The failures of one best-effort writer (a trace file, the metrics snapshots). Each failure is counted in
    ``METRICS`` under ``counter``; the first of each cause (exception type and errno) is logged as a warning,
    once per process, and the first success after a logged failure as one info line. Not thread-safe: one
    writer thread, or a lock around it."""

    def __init__(self, who: str, write: str, counter: str, then: str) -> None:
        self.who, self.write, self.counter, self.then = who, write, counter, then
        self._seen: set[tuple[str, int | None]] = set()
        self._announced = False

    def failed(self, error: BaseException) -> None:
        METRICS.add(self.counter)
        code = getattr(error, "errno", None)
        cause = (type(error).__name__, code if isinstance(code, int) else None)
        if cause in self._seen:
            return
        self._seen.add(cause)
        self._announced = True
        name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
        logger.warning("%s: %s failed (%s: %s); %s (counted in vllm:afd_%s; logged once per cause)", self.who,
                       self.write, name or type(error).__name__, error, self.then, self.counter)

    def succeeded(self) -> None:
        if self._announced:
            self._announced = False
            logger.info("%s: writing again", self.who)


# ------------------------------------------------------------------ worker side
def start_writer(role: str, rank: int) -> bool:
    """Write ``METRICS`` snapshots for the API server, if one asked for them; True when started."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        return False
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        logger.warning("AFD metrics: %s=%s is not a private directory of this user; not exporting",
                       METRICS_DIR_ENV, directory)
        return False
    path = os.path.join(directory, f"afd-{role}-{rank}-{os.getpid()}.json")
    threading.Thread(target=_write_loop, args=(path, role, rank), name="afd-metrics", daemon=True).start()
    return True


def _write_loop(path: str, role: str, rank: int) -> None:
    """Write a snapshot at most every ``WRITE_INTERVAL_S`` while the counters change, at once when the group state
    changed (``METRICS.urgent``); block while nothing changes (an idle engine costs this thread no wake-up). A
    change after ``clear()`` sets the event again, so the last change is always written. After a failed write, try
    again after a bounded backoff, changes or not."""
    snapshots = _SnapshotFile(path, role, rank)
    backoff = 0.0
    while True:
        if backoff:
            time.sleep(backoff)
        else:
            METRICS.changed.wait()
            METRICS.urgent.wait(WRITE_INTERVAL_S)
        METRICS.urgent.clear()
        METRICS.changed.clear()
        backoff = 0.0 if snapshots.write() else min(max(2 * backoff, WRITE_INTERVAL_S), MAX_BACKOFF_S)


class _SnapshotFile:
    """This process's snapshot at ``path``: replaced atomically, and renamed to ``path + STALE_SUFFIX`` when a
    write fails."""

    def __init__(self, path: str, role: str, rank: int) -> None:
        self.path, self.stale_path, self.role, self.rank = path, path + STALE_SUFFIX, role, rank
        self.last: dict[str, Any] | None = None  # what ``path`` holds now (None: write the next snapshot)
        self.marked = False  # ``stale_path`` may exist
        self.cannot_mark_logged = False
        self.failures = FailureLog("AFD metrics", "a snapshot write", "metrics_write_failures",
                                   "/metrics shows this rank as stale (vllm:afd_metrics_stale 1, no gauges) "
                                   "and the writer tries again")

    def write(self) -> bool:
        """Write the current snapshot unless ``path`` holds it already; True when done. Never raises."""
        try:
            snap = METRICS.snapshot()
            if snap != self.last:
                self._replace(snap)
                self.last = snap
            if self.marked:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.stale_path)
                self.marked = False
        except Exception as e:  # noqa: BLE001 - best-effort diagnostics: the writer outlives any one failure
            self._mark_stale()
            self.failures.failed(e)
            return False
        self.failures.succeeded()
        return True

    def _replace(self, snap: dict[str, Any]) -> None:
        data = memoryview(json.dumps({**snap, "role": self.role, "rank": self.rank}).encode())
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".tmp-")
        try:
            try:
                while data:
                    written = os.write(fd, data)
                    if written <= 0:  # a regular file says why instead; never spin here
                        raise OSError(errno.EIO, "the snapshot file took no bytes")
                    data = data[written:]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _mark_stale(self) -> None:
        """Keep the collector from reading the last snapshot as current: rename it (no free blocks needed),
        else remove it."""
        self.last = None
        try:
            os.replace(self.path, self.stale_path)
            self.marked = True
            return
        except FileNotFoundError:
            return  # nothing written yet, or marked already
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if not self.cannot_mark_logged:
                self.cannot_mark_logged = True
                logger.warning("AFD metrics: cannot mark the last snapshot stale nor remove it (%r); /metrics shows "
                               "its values until a write succeeds", e)


# ------------------------------------------------------------------ front end
def export_from_front_end() -> None:
    """Make this process's Prometheus registry show the AFD metrics of the engines it starts. Idempotent."""
    if os.environ.get(METRICS_DIR_ENV):
        return
    from prometheus_client import REGISTRY

    directory = tempfile.mkdtemp(prefix="afd-metrics-")  # mode 0700
    os.environ[METRICS_DIR_ENV] = directory
    atexit.register(_remove_if_mine, directory, os.getpid())
    REGISTRY.register(SnapshotCollector(directory))


def _remove_if_mine(directory: str, owner_pid: int) -> None:
    """At exit: remove the metrics directory, in the process that made it only (a forked child inherits the
    handler, and must not remove it under a running API server)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(directory, ignore_errors=True)


def attention_groups_down() -> list[int] | None:
    """From this front end's snapshots (no RPC: it answers while an engine is inside a step, a held one too):
    the ranks of the attention workers whose current snapshot says ``vllm:afd_group_up`` 0; None where no
    current attention snapshot says either (no directory, nothing written yet, or every one stale)."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        return None
    known, down = False, []
    for path, stale in _snapshot_files(directory):
        snap = None if stale else _read_snapshot(path)
        value = snap["counts"].get(GROUP_UP) if snap is not None and snap.get("role") == "attention" else None
        if value in (0, 1) and not isinstance(value, bool):
            known = True
            if value == 0:
                down.append(snap.get("rank"))  # type: ignore[union-attr]
    return down if known else None


def _snapshot_files(directory: str) -> list[tuple[str, bool]]:
    """The snapshot files of ``directory``, each with whether it is marked stale; a stale mark whose fresh
    snapshot is there too is left out (the writer wrote again and removes the mark next)."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return []
    files = []
    for name in sorted(names):
        if not name.startswith("afd-"):
            continue
        if name.endswith(".json"):
            files.append((os.path.join(directory, name), False))
        elif name.endswith(".json" + STALE_SUFFIX) and name.removesuffix(STALE_SUFFIX) not in names:
            files.append((os.path.join(directory, name), True))
    return files


def _read_snapshot(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_SNAPSHOT_BYTES:
            return None
        try:
            data = json.loads(fh.read(MAX_SNAPSHOT_BYTES))
        except (ValueError, RecursionError):
            return None
    if not isinstance(data, dict) or not isinstance(data.get("counts"), dict):
        return None
    numbers = [data["counts"].get(k, 0) for k in COUNTERS]
    for h in HISTOGRAMS.values():  # one a writer of an older release did not write reads as empty
        buckets = data.setdefault(h.buckets_key, [0] * (len(h.bounds) + 1))
        if not isinstance(buckets, list) or len(buckets) != len(h.bounds) + 1:
            return None
        numbers += [*buckets, data.setdefault(h.sum_key, 0.0)]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in numbers):
        return None
    return data


class SnapshotCollector:
    """A Prometheus collector over the snapshot files of one directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def describe(self) -> list[Any]:
        return []  # not known before the first scrape; prometheus_client then skips the name-clash check

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snaps, current = [], []  # every readable snapshot; those not marked stale
        for path, stale in _snapshot_files(self.directory):
            snap = _read_snapshot(path)
            if snap is not None:
                snap["stale"] = stale
                snaps.append(snap)
                if not stale:
                    current.append(snap)
        labels = ["role", "rank"]
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(f"vllm:afd_{key}", doc, labels=labels)
            for snap in snaps:
                family.add_metric([str(snap.get("role")), str(snap.get("rank"))], snap["counts"].get(key, 0))
            yield family
        for name, h in HISTOGRAMS.items():
            hist = HistogramMetricFamily(f"vllm:afd_{name}", h.doc, labels=labels)
            for snap in snaps:
                running, cumulative = 0, []
                for bound, n in zip([*map(str, h.bounds), "+Inf"], snap[h.buckets_key], strict=True):
                    running += n
                    cumulative.append((bound, running))
                hist.add_metric([str(snap.get("role")), str(snap.get("rank"))], cumulative, snap[h.sum_key])
            yield hist
        stale = GaugeMetricFamily(f"vllm:afd_{STALE}", STALE_DOC, labels=labels)
        for snap in snaps:
            stale.add_metric([str(snap.get("role")), str(snap.get("rank"))], int(snap["stale"]))
        yield stale
        gauge = GaugeMetricFamily(f"vllm:afd_{GROUP_UP}", GROUP_UP_DOC, labels=labels)
        for snap in current:
            value = snap["counts"].get(GROUP_UP)
            if value in (0, 1) and not isinstance(value, bool):
                gauge.add_metric([str(snap.get("role")), str(snap.get("rank"))], value)
        yield gauge
        hidden = GaugeMetricFamily(f"vllm:afd_{HIDDEN}", HIDDEN_DOC, labels=labels)
        for snap in current:
            span, wait = snap["counts"].get("exchange_span_seconds", 0), snap["counts"].get("exchange_wait_seconds", 0)
            if snap.get("role") == "attention" and span > 0:
                hidden.add_metric([str(snap.get("role")), str(snap.get("rank"))], max(0.0, 1.0 - wait / span))
        yield hidden
