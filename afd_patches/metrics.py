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
    ``WRITE_INTERVAL_S`` while it changes. Snapshots are data: each is opened
    without following links, must be a regular file of this user, at most
    ``MAX_SNAPSHOT_BYTES``, and only known numeric fields are read; anything
    else is skipped. While nothing changes the writer blocks (no periodic
    wake-up on an idle engine).

Metrics (labels ``role``, ``rank``)
    ``vllm:afd_exchanges`` (attention: layer exchanges answered; FFN: batched
    layer calls served), ``vllm:afd_exchange_latency_seconds`` (histogram;
    attention: send to answer; FFN: inputs received to outputs ready to send),
    ``vllm:afd_bytes_sent`` / ``vllm:afd_bytes_received`` (tensor payloads),
    ``vllm:afd_idle_steps`` (zero-token steps), ``vllm:afd_handshakes_accepted``
    / ``vllm:afd_handshakes_refused`` (rendezvous connections),
    ``vllm:afd_group_reformations`` (groups formed after the first), and on the
    attention role ``vllm:afd_steps``, ``vllm:afd_micro_batches`` (their ratio is
    the mean micro-batch count per step), ``vllm:afd_exchange_span_seconds`` and
    ``vllm:afd_exchange_wait_seconds``, with the gauge ``vllm:afd_ffn_hidden_fraction``
    (``1 - wait / span``: how much of the FFN's round trips overlapped attention).
    Counters get Prometheus' ``_total`` suffix on the wire. One gauge,
    ``vllm:afd_group_up`` (``set_group_up``): 1 while this rank's group is formed,
    0 while it waits for one (attention: from the loss of its FFN until the group
    re-forms; FFN: while it waits for a group, the first one included); a value
    other than 0 or 1 in a snapshot is skipped.

Limits
    Offline engines (``LLM(...)``) export nothing; their counters are in
    ``afd_stats()``. Values appear on ``/metrics`` up to ``WRITE_INTERVAL_S``
    late.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from afd_patches import LOGGER

logger = logging.getLogger(LOGGER)

METRICS_DIR_ENV = "AFD_METRICS_DIR"
WRITE_INTERVAL_S = 0.5
MAX_SNAPSHOT_BYTES = 64 * 1024
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
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
}
HIDDEN = "ffn_hidden_fraction"
HIDDEN_DOC = ("Attention role: 1 - exchange_wait_seconds / exchange_span_seconds, the fraction of the exchange "
              "round trips (FFN compute and transfer) that overlapped attention compute of another micro-batch.")


class AfdMetrics:
    """The counters and the exchange latency histogram of this process."""

    def __init__(self) -> None:
        self.changed = threading.Event()  # set by every update; the writer sleeps on it while nothing changes
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.latency_sum = 0.0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        if not self.changed.is_set():
            self.changed.set()

    def observe(self, seconds: float) -> None:
        """One exchange that took ``seconds``."""
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        if not self.changed.is_set():
            self.changed.set()

    def snapshot(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "buckets": list(self.buckets), "latency_sum": self.latency_sum}

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
    METRICS.counts[GROUP_UP] = int(up)
    METRICS.changed.set()


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
    """Write a snapshot at most every ``WRITE_INTERVAL_S`` while the counters change; block while they do not
    (an idle engine costs this thread no wake-up). A change after ``clear()`` sets the event again, so the last
    change is always written."""
    last: dict[str, Any] | None = None
    while True:
        METRICS.changed.wait()
        time.sleep(WRITE_INTERVAL_S)
        METRICS.changed.clear()
        snap = METRICS.snapshot()
        if snap == last:
            continue
        snap.update(role=role, rank=rank)
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
            with os.fdopen(fd, "w") as fh:
                json.dump(snap, fh)
            os.replace(tmp, path)
        except OSError:
            return  # the API server is gone and took its directory along
        last = {k: v for k, v in snap.items() if k not in ("role", "rank")}


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
    buckets = data.get("buckets")
    if not isinstance(buckets, list) or len(buckets) != len(LATENCY_BUCKETS) + 1:
        return None
    numbers = [*(data["counts"].get(k, 0) for k in COUNTERS), *buckets, data.get("latency_sum", 0.0)]
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

        snaps = []
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(self.directory)):
                if name.startswith("afd-") and name.endswith(".json"):
                    snap = _read_snapshot(os.path.join(self.directory, name))
                    if snap is not None:
                        snaps.append(snap)
        labels = ["role", "rank"]
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(f"vllm:afd_{key}", doc, labels=labels)
            for snap in snaps:
                family.add_metric([str(snap.get("role")), str(snap.get("rank"))], snap["counts"].get(key, 0))
            yield family
        hist = HistogramMetricFamily("vllm:afd_exchange_latency_seconds", "Time of one AFD layer exchange.",
                                     labels=labels)
        for snap in snaps:
            running, cumulative = 0, []
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], snap["buckets"], strict=True):
                running += n
                cumulative.append((bound, running))
            hist.add_metric([str(snap.get("role")), str(snap.get("rank"))], cumulative, snap["latency_sum"])
        yield hist
        gauge = GaugeMetricFamily(f"vllm:afd_{GROUP_UP}", GROUP_UP_DOC, labels=labels)
        for snap in snaps:
            value = snap["counts"].get(GROUP_UP)
            if value in (0, 1) and not isinstance(value, bool):
                gauge.add_metric([str(snap.get("role")), str(snap.get("rank"))], value)
        yield gauge
        hidden = GaugeMetricFamily(f"vllm:afd_{HIDDEN}", HIDDEN_DOC, labels=labels)
        for snap in snaps:
            span, wait = snap["counts"].get("exchange_span_seconds", 0), snap["counts"].get("exchange_wait_seconds", 0)
            if snap.get("role") == "attention" and span > 0:
                hidden.add_metric([str(snap.get("role")), str(snap.get("rank"))], max(0.0, 1.0 - wait / span))
        yield hidden
