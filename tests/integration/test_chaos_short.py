"""The chaos benchmark's short schedule as a test: 1A1F behind the OpenAI server, each engine in its own network
namespace, the FFN reached by name, under load, through three faults (``benchmarks.chaos_faults``):

``kill_ffn``  the FFN server SIGKILLed and started again;
``stop_ffn``  the FFN server SIGSTOPped for 3 x ``timeout_s``, then SIGCONTed;
``name``      the FFN's name stops resolving while its link is down long enough to break the group, and resolves
              again 2 s after the link is back: the attention side re-forms through failed look-ups.

Four concurrent greedy streams of the module's prompt, each answer compared with plain offline vLLM's
(``plain_generation``). Every phase must meet the benchmark's goals (``benchmarks.chaos.met``): no request wrong,
lost, hung or failed without naming the cause; every attention server answering exactly again within
2 x ``timeout_s`` of the fault's end; ``vllm:afd_group_up`` never contradicting the requests for longer than
``timeout_s``. Needs root (namespaces, a tmpfs): the test fails, never skips, where a namespace cannot be made.
Everything it makes is removed in ``finally``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos import met, schedule_under_load, table
from benchmarks.chaos_deploy import Deployment
from benchmarks.netns import Lab, LabError
from tests.integration.test_afd_server import MAX_TOKENS, PROMPT

pytestmark = pytest.mark.vllm

# vLLM starts: the session's plain engine (plain_generation), the FFN and attention servers, the FFN's restart.
ENGINE_BUDGET = 4

TIMEOUT_S = 2.0
STREAMS = 4
HANG_S = 60.0
FAULTS = ["kill_ffn", "stop_ffn", "name"]


def test_short_chaos_schedule(model_dir: Path, plain_generation: Any, tmp_path: Path) -> None:
    t0 = time.monotonic()
    lab = Lab()
    try:
        try:
            lab.open()
            d = Deployment(lab, "llama", model_dir, 1, TIMEOUT_S, tmp_path)
        except LabError as e:
            pytest.fail(f"no network namespace for the chaos schedule (root and iproute2 needed): {e}")
        try:
            up_s = d.start()
            expected = [plain_generation.result["tokens"][0]]
            phases, settled = schedule_under_load(d, [PROMPT], expected, MAX_TOKENS, STREAMS, HANG_S, FAULTS)
        finally:
            d.stop_all()
    finally:
        lab.close()
    text = table(f"1A1F, {STREAMS} streams x {MAX_TOKENS} tokens, timeout_s {TIMEOUT_S:g}, up in {up_s:.0f}s, "
                 f"test {time.monotonic() - t0:.0f}s", phases, TIMEOUT_S)
    print(text)
    assert settled, f"requests still open after the schedule:\n{text}"
    assert [p.name for p in phases] == ["steady", *FAULTS]
    assert phases[0].counts["exact"] > 0, text
    missed = [p.name for p in phases if not met(p, TIMEOUT_S)]
    assert not missed, f"goals missed by {missed}:\n{text}"
