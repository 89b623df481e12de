"""Per-process JSON reports and the cross-process check.

With ``PATCHKIT_REPORT_DIR`` set, every process writes
``<dir>/<plugin>-<pid>.json`` after each change of its plan's state: pid,
process role, plan digest, and each entry's outcome, fingerprint verdict and
time. Reports hold no environment variables and no argument values.

``check(dir)`` reads them all and says whether every process applied the same
plan (same digest) without failure.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any


def process_role() -> str:
    """``PATCHKIT_PROCESS_ROLE``, else vLLM's process title (``VLLM::Worker`` → ``Worker``), else ``main``."""
    if os.environ.get("PATCHKIT_PROCESS_ROLE"):
        return os.environ["PATCHKIT_PROCESS_ROLE"]
    setproctitle = sys.modules.get("setproctitle")
    if setproctitle is not None:
        title = setproctitle.getproctitle()
        if "::" in title:
            return title.split("::", 1)[1].split()[0]
    name = multiprocessing.current_process().name
    return "main" if name == "MainProcess" else name


def write(report: dict[str, Any]) -> Path | None:
    directory = os.environ.get("PATCHKIT_REPORT_DIR")
    if not directory:
        return None
    path = Path(directory) / f"{report['plugin']}-{os.getpid()}.json"
    write_atomic(path, json.dumps({"pid": os.getpid(), "role": process_role(), **report}).encode())
    return path


def load_all(directory: Path) -> list[dict[str, Any]]:
    reports = []
    for p in sorted(directory.glob("*.json")):
        try:
            reports.append({"file": p.name, **json.loads(p.read_text())})
        except (OSError, ValueError) as exc:
            reports.append({"file": p.name, "status": "unreadable", "error": str(exc), "digest": None})
    return reports


def check(directory: Path) -> tuple[bool, list[str]]:
    """(all processes agree and none failed, human-readable lines)."""
    reports = load_all(directory)
    if not reports:
        return False, [f"no reports in {directory}"]
    lines = []
    for r in reports:
        counts: dict[str, int] = {}
        for e in r.get("entries", []):
            counts[e["outcome"]] = counts.get(e["outcome"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        lines.append(f"{r['file']}: pid {r.get('pid')} role {r.get('role')} plan {r.get('digest')} "
                     f"{r.get('status')}: {summary}" + (f" — {r['error']}" if r.get("error") else ""))
    digests = {r.get("digest") for r in reports}
    failed = [r for r in reports if r.get("status") not in ("active", "reverted")]
    ok = len(digests) == 1 and not failed
    if len(digests) != 1:
        lines.append(f"MISMATCH: {len(digests)} different plans: {', '.join(sorted(map(str, digests)))}")
    if failed:
        lines.append(f"FAILED: {len(failed)} process(es) did not apply their plan")
    lines.append(f"{'OK' if ok else 'NOT OK'}: {len(reports)} process(es), plan {'/'.join(sorted(map(str, digests)))}")
    return ok, lines


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) via a temp file + rename; OSError is ignored.

    For files a user asked for in a folder they chose (``PATCHKIT_REPORT_DIR``): no ownership rules."""
    import tempfile

    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
