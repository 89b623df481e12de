"""vLLM's model-inspection cache, filled once per test session for the architectures of ``harness.tiny_model``.

What vLLM does: before an engine starts, vLLM asks what the model class supports (``_ModelInfo``). For a class
registered by module path (every built-in model, and the plugin's AFD models) it answers from
``$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`` when that file names the current hash of the module's source,
and otherwise imports the class in a fresh ``python -m vllm.model_executor.models.registry`` process (a whole vLLM
import, about 8 s of CPU on this project's 2-core host) and writes the answer there. Engines started side by side
on a cold cache each run that process for the same class (an AFD pair and its plain reference: three).

What this does: ``python -m harness.model_infos`` loads vLLM's general plugins (so the AFD architectures are
registered, as in an engine) and asks vLLM's registry to inspect every plain and AFD architecture of the tiny
families, answering in this one process instead of one subprocess per class (the subprocess exists so that a
CUDA caller does not initialise CUDA; this process is a throwaway). vLLM's own code computes the answer, the
module hash and the file, so an engine later reads exactly what it would have written itself. A release whose
registry has no ``_run_in_subprocess`` is left to inspect as it does (the module says so and exits 0); any other
failure errors the session's real-vLLM tests, naming it. Having filled, it reads every answer back as an engine
would (an answer vLLM failed to save, which vLLM only logs, fails the fill). ``warm_once`` runs it once per test
session, whichever pytest-xdist worker asks first. ``--cached-only`` checks instead of filling: each architecture
must be answered from the cache, as an engine started afterwards would read it; each miss is named on the exit
line with what lies at its cache file (absent, or the hash it holds and its age).

Limits: only the tiny families' architectures (``ARCHITECTURES``); a test that points ``VLLM_CACHE_ROOT``
elsewhere inspects there as vLLM does. Nothing here changes what an engine computes.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

from harness.env import REPO, vllm_env
from harness.tiny_model import FAMILIES

ARCHITECTURES = tuple(name for cls, _ in FAMILIES.values() for name in (f"{cls}ForCausalLM", f"AFD{cls}ForCausalLM"))
TIMEOUT_S = 600.0
_DONE = "model-infos.done"


def warm_once(session_dir: Path) -> str:
    """Fill the cache for this session unless a worker of the same session already did (``session_dir``: the
    session's own private folder, shared by its workers); what the filling process printed, or ``""``."""
    with open(session_dir / "model-infos.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = session_dir / _DONE
        if done.exists():
            return ""
        run = subprocess.run([sys.executable, "-m", "harness.model_infos"], capture_output=True, text=True,
                             env=vllm_env(), cwd=REPO, timeout=TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"harness.model_infos exited {run.returncode}:\n{run.stdout[-2000:]}"
                               f"{run.stderr[-4000:]}")
        done.write_text(run.stdout)
        return run.stdout


class _Refused(Exception):
    """An inspection that would have run in a subprocess: not answered from the cache."""


def _refuse(fn: object) -> None:
    raise _Refused


def _cache_file_state(model: object) -> str:
    """What lies at the model's cache file, for a miss's message: absent, or its size, age and stored hash."""
    try:
        path = Path(model._get_cache_dir()) / model._get_cache_filename()  # type: ignore[attr-defined]
    except AttributeError:
        return "(this vLLM names no cache file)"
    try:
        stat, stored = path.stat(), json.loads(path.read_text()).get("hash")
    except FileNotFoundError:
        return f"{path} absent"
    except (OSError, ValueError, AttributeError) as exc:
        return f"{path} unreadable ({exc!r})"
    return f"{path} holds hash {stored!r}, {stat.st_size} B, written {time.time() - stat.st_mtime:.0f} s ago"


def _misses(registry: object, archs: list[str]) -> list[str]:
    """The architectures of ``archs`` vLLM's registry does not answer from the cache, each with its file's state."""
    misses = []
    for arch in archs:
        model = registry.models[arch]  # type: ignore[attr-defined]
        try:
            model.inspect_model_cls()
        except _Refused:
            misses.append(f"{arch}: {_cache_file_state(model)}")
    return misses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached-only", action="store_true",
                        help="inspect from the cache alone (an inspection in a subprocess fails): a check, not a fill")
    cached_only = parser.parse_args(argv).cached_only
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if not callable(getattr(registry, "_run_in_subprocess", None)):
        print("model infos: this vLLM's registry has no _run_in_subprocess; engines inspect as vLLM does")
        return
    known = set(ModelRegistry.get_supported_archs())
    archs = [arch for arch in ARCHITECTURES if arch in known]
    if not cached_only:  # this process is the throwaway one: each class is inspected here and its answer saved
        registry._run_in_subprocess = lambda fn: fn()
        for arch in archs:
            ModelRegistry.models[arch].inspect_model_cls()
    # the check, and the fill's proof that it saved every answer: an inspection in a subprocess is a miss
    registry._run_in_subprocess = _refuse
    misses = _misses(ModelRegistry, archs)
    if misses:
        sys.exit("model infos: not answered from the cache: " + "; ".join(misses))
    how = "answered from the cache" if cached_only else "inspected in one process, then answered from the cache"
    print(f"model infos: {len(archs)} architectures {how} ({len(ARCHITECTURES) - len(archs)} not registered "
          f"on this vLLM)")


if __name__ == "__main__":
    main()
