"""``vllm:afd_group_up``: 1 while this rank's AFD group is formed, 0 while it waits for one.

A gauge beside the counters of ``afd_patches.connectors.metrics``, kept
self-contained so that it can join them when that module moves: the worker
keeps the value in the same snapshot (``METRICS.counts["group_up"]``; a
snapshot copies every key of ``counts``, the counters' collector reads only
its own), and ``GroupUpCollector``, registered in the API server's process by
``export_from_front_end`` (after the counters' export), reads it back from the
same snapshot files, validated by the same reader; a value other than 0 or 1
is skipped.

Attention rank: 1 from its first group on, 0 from the loss of its FFN until
the group re-forms. FFN rank: 0 while it waits for a group (the first one
included), 1 while it serves one. Limits: as for the counters (offline
engines export nothing; values appear up to ``WRITE_INTERVAL_S`` late).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from afd_patches.connectors import metrics

KEY = "group_up"
DOC = "1 while this AFD rank's group is formed, 0 while it waits for one (FFN lost, or no attention rank yet)."
_EXPORTED: list[bool] = []


def set_up(up: bool) -> None:
    """Record this process's group state for the next snapshot."""
    metrics.METRICS.counts[KEY] = int(up)
    metrics.METRICS.changed.set()


def export_from_front_end() -> None:
    """Register ``GroupUpCollector`` over the snapshot directory the counters' export created. Idempotent;
    nothing when there is none."""
    directory = os.environ.get(metrics.METRICS_DIR_ENV)
    if _EXPORTED or not directory:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(GroupUpCollector(directory))
    _EXPORTED.append(True)


class GroupUpCollector:
    """A Prometheus collector of ``vllm:afd_group_up`` over the snapshot files of one directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(f"vllm:afd_{KEY}", DOC, labels=["role", "rank"])
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(self.directory)):
                if not (name.startswith("afd-") and name.endswith(".json")):
                    continue
                snap = metrics._read_snapshot(os.path.join(self.directory, name))
                value = snap["counts"].get(KEY) if snap is not None else None
                if value in (0, 1) and not isinstance(value, bool):
                    family.add_metric([str(snap.get("role")), str(snap.get("rank"))], value)  # type: ignore[union-attr]
        yield family
