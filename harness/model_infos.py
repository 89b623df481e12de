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
failure errors the session's real-vLLM tests, naming it. ``warm_once`` runs it once per test session, whichever
pytest-xdist worker asks first. ``--cached-only`` checks instead of filling: each architecture must be answered
from the cache (an inspection in a subprocess raises), as an engine started afterwards would read it.

Limits: only the tiny families' architectures (``ARCHITECTURES``); a test that points ``VLLM_CACHE_ROOT``
elsewhere inspects there as vLLM does. Nothing here changes what an engine computes.
"""

from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
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


def _refuse(fn: object) -> None:
    raise AssertionError("inspected in a subprocess: not in vLLM's model-inspection cache")


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
    # filling: this process is the throwaway one, so the class is inspected here; checking: a miss raises
    registry._run_in_subprocess = _refuse if cached_only else lambda fn: fn()
    known = set(ModelRegistry.get_supported_archs())
    inspected = []
    for arch in ARCHITECTURES:
        if arch in known:
            ModelRegistry.models[arch].inspect_model_cls()
            inspected.append(arch)
    how = "answered from the cache" if cached_only else "inspected in one process"
    print(f"model infos: {len(inspected)} architectures {how} "
          f"({len(ARCHITECTURES) - len(inspected)} not registered on this vLLM)")


if __name__ == "__main__":
    main()
