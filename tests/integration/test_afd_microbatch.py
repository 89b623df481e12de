"""AFD micro-batches on real vLLM (CPU build): split steps stay token-exact against plain vLLM.

Each step of at least ``micro_batch_min_tokens`` tokens (set to N here, so decode steps of the three
prompts split too) runs as N micro-batches whose attention and FFN overlap
(``afd_patches.models.microbatch``). Checks: greedy tokens and top-5 logprobs identical to plain vLLM's;
the attention rank really ran split steps (more micro-batches than steps); every micro-batch message was
answered (messages = layers x micro-batches, FFN calls = messages in 1A1F). Marked ``vllm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.engine import ARCH
from tests.integration.test_afd_e2e import _afd, _assert_same_outputs, _model_and_plain, _run_engines, _spec

pytestmark = pytest.mark.vllm


def _micro(afd: dict[str, Any], n: int) -> dict[str, Any]:
    extra = {**afd["connector_extra_config"], "micro_batches": n, "micro_batch_min_tokens": n}
    return {**afd, "connector_extra_config": extra}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afd-ubatch")


def _check_split(attn: dict[str, Any], ffn: dict[str, Any] | None, n: int) -> None:
    a = attn["stats"][0]
    assert a["steps"] > 0 and a["exchanges"] == a["layers"] * a["steps"]
    if n > 1:
        assert a["micro_batches"] > a["steps"], "no step was split"
    assert a["messages_sent"] == a["messages_received"] == a["layers"] * a["micro_batches"]
    if ffn is not None:
        f = ffn["stats"][0]
        assert f["ffn_batches"] == f["messages_received"] == a["messages_sent"]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("family", sorted(ARCH))
def test_micro_batches_match_plain_vllm(workdir: Path, family: str, n: int) -> None:
    model, plain = _model_and_plain(workdir, family)
    afd = _micro(_afd(1), n)
    ffn, attn = _run_engines([
        _spec(f"{family}-ub{n}-ffn", "ffn", model, family, {**afd, "role": "ffn"}),
        _spec(f"{family}-ub{n}-attn", "attention", model, family, {**afd, "role": "attention"}),
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, n)
