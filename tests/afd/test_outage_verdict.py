"""``afd_patches.patches.outage``: when does a failed step count as an AFD group loss?

The engine core asks its workers after the step raised; by then the group may have re-formed. A group that was down
at any moment since the step began (lost before it and re-formed since, the race a 2A1F run under load hit) must
fail the step's requests and keep the engine, never let the error end the engine core. Real vLLM's engine core
with a real group is tests/integration/test_afd_server.py; here its scheduler and executor are stand-ins, so each
timing of the race is set exactly.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from afd_patches.patches import outage
from afd_patches.workers.regroup import GroupStatus


class _Scheduler:
    def __init__(self) -> None:
        self.reset = False

    def finish_requests(self, ids: Any, status: Any) -> list[Any]:
        return [SimpleNamespace(client_index=0, request_id="r1")]

    def reset_prefix_cache(self) -> None:
        self.reset = True

    def get_num_unfinished_requests(self) -> int:
        return 1


def _core(status: GroupStatus) -> Any:
    executor = SimpleNamespace(collective_rpc=lambda name, timeout: [status.as_json()])
    config = SimpleNamespace(additional_config={"afd": {"role": "attention"}})
    return SimpleNamespace(vllm_config=config, model_executor=executor, scheduler=_Scheduler())


def _failing_step(core: Any) -> Any:
    raise RuntimeError("AfdGroupDown: AFD: attention rank 1 lost its FFN role at ffn:1")


def _run(status: GroupStatus) -> Any:
    core = _core(status)
    return core, outage.step_outliving_ffn(_failing_step, core)


@pytest.mark.parametrize("when", ["down now", "lost during the step", "lost before, re-formed during the step"])
def test_a_step_that_met_a_down_group_fails_its_requests_not_the_engine(when: str) -> None:
    now = time.time()
    status = {"down now": GroupStatus(False, "AFD: down", since=now - 60, outages=1),
              "lost during the step": GroupStatus(True, "AFD: lost", since=now + 1, reformed_at=now + 2, outages=1,
                                                  reformations=1),
              "lost before, re-formed during the step": GroupStatus(True, "AFD: lost", since=now - 5,
                                                                    reformed_at=now + 1, outages=1,
                                                                    reformations=1)}[when]
    core, (outputs, executed) = _run(status)
    assert not executed and core.scheduler.reset
    assert [o.finish_reason.name for o in outputs[0].outputs] == ["ERROR"] and outputs[0].finished_requests == {"r1"}
    # a group still down is remembered, so the next steps fail their requests without reaching the model
    assert (getattr(core, outage._DOWN, None) is not None) == (not status.up)


def test_a_step_that_failed_while_the_group_stayed_up_ends_as_vllm_would() -> None:
    earlier = time.time() - 60
    with pytest.raises(RuntimeError, match="AfdGroupDown"):
        _run(GroupStatus(True, "AFD: old", since=earlier - 5, reformed_at=earlier, outages=1, reformations=1))
    with pytest.raises(RuntimeError, match="AfdGroupDown"):
        _run(GroupStatus(True))


def test_another_engine_runs_vllms_step_unchanged() -> None:
    core = _core(GroupStatus(False, "AFD: down"))
    core.vllm_config.additional_config = {}
    with pytest.raises(RuntimeError):
        outage.step_outliving_ffn(_failing_step, core)
