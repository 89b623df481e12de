"""vLLM's front-end configuration step for many cases in one process: ``create_engine_config()`` probes.

A front end that refuses a configuration does so while it builds vLLM's engine config, before any engine
process starts. This runs that step, and only that step, for each case of a list, in one process that imports
vLLM (and loads its plugins: afd's validation runs inside ``EngineArgs``) once:

- ``{"name": N, "engine_args": {...}}``: ``EngineArgs(**engine_args).create_engine_config()``, as ``LLM(...)``
  does (``harness.engine``);
- ``{"name": N, "cli": [ARG, ...]}``: the OpenAI API server's path (``python -m
  vllm.entrypoints.openai.api_server ARG ...``): its parser (``make_arg_parser``, which carries the ``--afd-*``
  flags once the plugins are loaded), ``validate_parsed_serve_args``, then
  ``AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=OPENAI_API_SERVER)``.

Per case the result is ``{"name", "refused", "error", "exception", "config", "seconds"}``: ``error`` the
exception as the front end would print it, traceback and chained exceptions included, ``exception`` its
``"TypeName: message"`` (both ``None`` when accepted; an ``argparse`` exit is reported as ``SystemExit`` with
what the parser wrote to stderr), ``config`` for an accepted case ``enforce_eager`` and the compilation
``mode`` name. Nothing is served and no engine starts.

    python -m harness.config_probe CASES.json OUT.json

From the tests: ``probe(cases, workdir, **env)`` runs one such process in ``harness.env.vllm_env(**env)``
(counted as one front end: ``harness.starts``) and returns ``Probe``: the results by name and the process
output; it raises ``AssertionError`` with the output when the process itself fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import starts
from harness.env import vllm_env

PROBE_TIMEOUT_S = 600.0


@dataclass(slots=True, frozen=True)
class Probe:
    """One probe process: each case's result by name, and the process's whole output."""

    results: dict[str, dict[str, Any]]
    output: str


def probe(cases: list[dict[str, Any]], workdir: Path, timeout_s: float = PROBE_TIMEOUT_S,
          unset: tuple[str, ...] = (), **env: str) -> Probe:
    """Run ``cases`` in one probe process (environment ``vllm_env(**env)`` without the variables ``unset``);
    every case gets a result."""
    names = [case["name"] for case in cases]
    assert len(set(names)) == len(names), f"case names must be unique: {names}"
    spec, out = workdir / "probe-cases.json", workdir / "probe-results.json"
    spec.write_text(json.dumps(cases))
    out.unlink(missing_ok=True)
    environ = {k: v for k, v in vllm_env(**env).items() if k not in unset}
    run = starts.run([sys.executable, "-m", "harness.config_probe", str(spec), str(out)], environ, timeout_s)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and out.exists(), f"the probe process failed ({run.returncode}):\n{output[-4000:]}"
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert sorted(results) == sorted(names), (sorted(results), names)
    return Probe(results, output)


def _error(exc: BaseException) -> str:
    """The exception with its traceback and chained exceptions, as the front end would print it."""
    return "".join(traceback.format_exception(exc)).strip()


def _from_cli(argv: list[str]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # where the API server's entry (vllm.entrypoints.launchers.api_server.entry) takes them from
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # releases before the launchers package
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args  # type: ignore
    parser = make_arg_parser(FlexibleArgumentParser(description="config probe"))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse refused a flag: report what it printed
        raise SystemExit(f"exit {exc.code}: {stderr.getvalue().strip()}") from None
    validate_parsed_serve_args(args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _one(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs

    started = time.monotonic()
    result: dict[str, Any] = {"name": case["name"], "refused": False, "error": None, "exception": None,
                              "config": None}
    try:
        if "cli" in case:
            config = _from_cli(case["cli"])
        else:
            config = EngineArgs(**case["engine_args"]).create_engine_config()
        result["config"] = {"enforce_eager": config.model_config.enforce_eager,
                            "mode": config.compilation_config.mode.name}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any refusal is a result: the test judges its message
        result.update(refused=True, error=_error(exc), exception=f"{type(exc).__name__}: {exc}")
    result["seconds"] = time.monotonic() - started
    return result


def main(cases_path: str, out_path: str) -> None:
    from harness.tiny_model import register_configs

    register_configs()
    results = []
    for case in json.loads(Path(cases_path).read_text()):
        results.append(_one(case))
        print(f"probe {case['name']}: {'refused' if results[-1]['refused'] else 'accepted'}", flush=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
