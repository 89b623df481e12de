"""Plain vLLM's results, cached by content under ``.cache/plain/``: one computation per (checkpoint, vLLM release,
settings, CPU ISA).

A plain run is the reference AFD is compared with; on the same checkpoint, release, settings and CPU it gives the
same tokens and logprobs every time (greedy, seed 0, one thread). ``run_engines`` (``harness.engine``) takes a plain
spec's result from here when one is stored under its key and stores what a plain run returns.

The key (``key``) is a SHA-256 over: the checkpoint's files (bytes, not path), ``engine_kwargs(spec)`` less the
model path, the prompts, ``max_tokens``, ``logprobs``, the runner and extra environment, vLLM's and torch's
versions, the CPU's ISA flags (``/proc/cpuinfo``), and ``harness/engine.py`` and ``harness/engine_args.py``
themselves (how a run is made). Not in it: the plugin's code; a plain run goes through the plugin's hook with AFD
off, and ``test_vllm_plugin`` compares that, uncached, with vLLM without the plugin in every run.

Reading follows the project's rule for shared places: the file is opened without following a symlink, must be a
regular file owned by this user, and must parse as a result of the expected shape (tokens and logprobs for every
prompt, ``max_tokens`` each); anything else is a miss, never an error. Used only where ``ENV`` is ``1`` (the test
session sets it); the demo and the benchmarks always run plain vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.engine_args import engine_kwargs
from harness.env import REPO, vllm_release

ENV = "HARNESS_PLAIN_CACHE"
FOLDER = REPO / ".cache" / "plain"
_MAX_BYTES = 1 << 22


def enabled() -> bool:
    """Whether plain results are cached in this process (``ENV`` is ``1``)."""
    return os.environ.get(ENV) == "1"


def _digest_files(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _isa() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags")), "")
    return " ".join(sorted(set(flags.split())))


def key(spec: dict[str, Any]) -> str:
    """The content key of a plain ``spec`` (see the module docstring)."""
    kwargs = {k: v for k, v in engine_kwargs(spec).items() if k != "model"}
    material = {
        "checkpoint": _digest_files(Path(spec["model"])), "kwargs": kwargs, "prompts": spec["prompts"],
        "max_tokens": spec["max_tokens"], "logprobs": spec["logprobs"], "runner": spec.get("runner"),
        "env": spec.get("env", {}), "multiprocessing": spec.get("multiprocessing", False), "release": vllm_release(),
        "torch": metadata.version("torch"), "isa": _isa(),
        "driver": hashlib.sha256(b"".join((REPO / "harness" / name).read_bytes()
                                          for name in ("engine.py", "engine_args.py"))).hexdigest(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _valid(result: Any, spec: dict[str, Any]) -> bool:
    """Whether ``result`` has the shape of a plain run of ``spec``."""
    if not isinstance(result, dict):
        return False
    tokens, logprobs = result.get("tokens"), result.get("logprobs")
    n, steps = len(spec["prompts"]), spec["max_tokens"]
    return (isinstance(tokens, list) and len(tokens) == n
            and all(isinstance(t, list) and len(t) == steps and all(isinstance(x, int) for x in t) for t in tokens)
            and isinstance(logprobs, list) and len(logprobs) == n
            and all(isinstance(seq, list) and len(seq) == steps and all(
                isinstance(step, dict) and all(isinstance(v, float) for v in step.values()) for step in seq)
                for seq in logprobs))


def load(spec: dict[str, Any], spec_key: str | None = None) -> dict[str, Any] | None:
    """The stored result for ``spec`` (under ``spec_key``, default ``key(spec)``), or None (nothing stored, or what is
    stored fails a check)."""
    path = FOLDER / f"{spec_key or key(spec)}.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > _MAX_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            result = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return {**result, "cached": True} if _valid(result, spec) else None


def store(spec: dict[str, Any], result: dict[str, Any], spec_key: str | None = None) -> None:
    """Keep ``result`` (a plain run of ``spec``) under ``spec_key`` (default ``key(spec)``); written whole or not at
    all."""
    if not _valid(result, spec):
        return
    FOLDER.mkdir(parents=True, exist_ok=True)
    path = FOLDER / f"{spec_key or key(spec)}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
