"""Per-process JSON reports and the cross-process check.

With ``PATCHKIT_REPORT_DIR`` set, every process writes
``<dir>/<plugin>-<pid>.json`` after each change of its plan's state: pid,
process role, plan digest, each entry's outcome, fingerprint verdict and
time, and the facts the plugin noted (``patchkit.note``: e.g. the model
runner). Reports hold no environment variables and no argument values.

``check(dir)`` reads them all and says whether every process applied the same
plan (same digest) and the same verdict (its summary, and the entries it left out: ``feature-off``,
``refused``) without failure. It reads a report as the plan cache reads
its files (``patchkit.runtime.cache.read_own``): this user's own regular file,
one link, not writable by others, at most ``MAX_BYTES``, opened without
following a symlink or waiting on a FIFO. Any other ``*.json`` entry, and one
that is not a JSON object, is named with the reason and fails the check.
The folder itself is not judged: whoever may write it can remove reports.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

from patchkit.runtime.cache import UntrustedFile, read_own

MAX_BYTES = 1 << 20  # a report is a few KB


def process_role() -> str:
    """``PATCHKIT_PROCESS_ROLE``, else vLLM's process title (``PREFIX::Name``, e.g. ``VLLM::Worker`` → ``Worker``),
    else ``main``. A title whose part before ``::`` is not one word (pytest-xdist's ``[pytest-xdist running]
    file.py::test``) is another program's, not a role."""
    if os.environ.get("PATCHKIT_PROCESS_ROLE"):
        return os.environ["PATCHKIT_PROCESS_ROLE"]
    setproctitle = sys.modules.get("setproctitle")
    if setproctitle is not None:
        prefix, sep, rest = setproctitle.getproctitle().partition("::")
        if sep and prefix and not any(c.isspace() or c in "/[]" for c in prefix) and rest.split():
            return rest.split()[0]
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
    """The ``*.json`` reports in ``directory`` (hidden names skipped), by name, each with its ``file`` name.

    ``not_read`` is None for a report read; ``"refused"`` for a file ``read_own`` refuses and ``"unreadable"``
    for one that cannot be read or is not a JSON object, with the reason in ``error``. ``OSError`` when the
    folder cannot be listed."""
    reports = []
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for name in sorted(n for n in os.listdir(dir_fd) if n.endswith(".json") and not n.startswith(".")):
            try:
                data = json.loads(read_own(name, dir_fd=dir_fd, max_bytes=MAX_BYTES))
            except UntrustedFile as exc:
                reports.append({"file": name, "not_read": "refused", "error": str(exc)})
            except (OSError, ValueError, RecursionError) as exc:
                reports.append({"file": name, "not_read": "unreadable", "error": f"{type(exc).__name__}: {exc}"})
            else:
                reports.append({**data, "file": name, "not_read": None} if isinstance(data, dict) else
                               {"file": name, "not_read": "unreadable", "error": "not a JSON object"})
    finally:
        os.close(dir_fd)
    return reports


def check(directory: Path) -> tuple[bool, list[str]]:
    """(all processes agree and none failed and every report was read, human-readable lines)."""
    reports = load_all(directory)
    if not reports:
        return False, [f"no reports in {directory}"]
    lines = []
    read, unread = [], []
    for r in reports:
        if r["not_read"]:
            unread.append(r)
            lines.append(f"{r['file']}: {r['not_read'].upper()}: {r['error']}")
            continue
        read.append(r)
        counts: dict[str, int] = {}
        entries = r.get("entries")
        for e in entries if isinstance(entries, list) else []:
            outcome = str(e.get("outcome")) if isinstance(e, dict) else "malformed"
            counts[outcome] = counts.get(outcome, 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        facts = r.get("facts")
        noted = "".join(f"; {k} {v}" for k, v in sorted(facts.items())) if isinstance(facts, dict) else ""
        lines.append(f"{r['file']}: pid {r.get('pid')} role {r.get('role')} plan {r.get('digest')} "
                     f"{r.get('status')}: {summary}{noted}" + (f" — {r['error']}" if r.get("error") else ""))
    digests = {str(r.get("digest")) for r in read}
    verdicts = {_verdict_of(r) for r in read}
    decided = {_decided(r) for r in read}
    failed = [r for r in read if r.get("status") not in ("active", "reverted")]
    ok = len(digests) == 1 and len(verdicts) == 1 and len(decided) == 1 and not failed and not unread
    if len(digests) > 1:
        lines.append(f"MISMATCH: {len(digests)} different plans: {', '.join(sorted(digests))}")
    if len(verdicts) > 1:
        lines.append(f"MISMATCH: {len(verdicts)} different verdicts: {'; '.join(sorted(verdicts))}")
    if len(decided) > 1:
        lines.append("MISMATCH: the verdict's outcomes differ between processes: "
                     + "; ".join(", ".join(d) or "none" for d in sorted(decided)))
    if failed:
        lines.append(f"FAILED: {len(failed)} process(es) did not apply their plan")
    if unread:
        lines.append(f"NOT READ: {len(unread)} file(s): {', '.join(r['file'] for r in unread)}")
    lines.append(f"{'OK' if ok else 'NOT OK'}: {len(read)} process(es), plan {'/'.join(sorted(digests))}")
    return ok, lines


def _verdict_of(report: dict[str, Any]) -> str:
    """The report's verdict summary as one comparable string (``none``: the plan had no verdict)."""
    verdict = report.get("verdict")
    return json.dumps(verdict, sort_keys=True) if verdict is not None else "none"


VERDICT_OUTCOMES = ("feature-off", "refused")  # outcomes the verdict decides: equal in every process


def _decided(report: dict[str, Any]) -> tuple[str, ...]:
    """``id: outcome`` of the entries whose outcome the verdict decided (``VERDICT_OUTCOMES``). Other
    outcomes may differ by process (an entry waits until its module is imported there)."""
    entries = report.get("entries")
    return tuple(sorted(f"{e.get('id')}: {e.get('outcome')}" for e in entries if isinstance(e, dict)
                        and e.get("outcome") in VERDICT_OUTCOMES)) if isinstance(entries, list) else ("malformed",)


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
