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

from harness.delay_link import DelayLink
from harness.engine import ARCH
from tests.integration.test_afd_e2e import (
    PLAIN_CANNOT_RUN,
    _afd,
    _assert_same_outputs,
    _model,
    _model_and_plain,
    _run_engines,
    _spec,
    pair_1a1f,
)

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 121 alone: 14 plains, 43 pairs, four 2A1F
# triples, the compiled triple, two mixed triples; after test_afd_e2e 79, its plain results and its 14 1A1F pairs
# (the N = 1 column) shared.
ENGINE_BUDGET = 121
# On the pytest-xdist worker of the other module that shares the 1A1F pairs (tests/conftest.py).
XDIST_GROUP = "afd-1a1f-pairs"


def _micro(afd: dict[str, Any], n: int) -> dict[str, Any]:
    extra = {**afd["connector_extra_config"], "micro_batches": n, "micro_batch_min_tokens": n}
    return {**afd, "connector_extra_config": extra}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afd-ubatch")


# MLA models run unsplit (afd_patches.patches.micro_batches: split steps were not exact on vLLM's CPU MLA backend)
UNSPLIT = {"deepseek_v2", "deepseek_v3"}


def _check_split(attn: dict[str, Any], ffn: dict[str, Any] | None, n: int, padded: bool = False,
                 unsplit: bool = False) -> None:
    """Split steps happened (``unsplit``: none did); one message per layer and micro-batch (``padded``: N per
    layer in every step)."""
    a = attn["stats"][0]
    assert a["steps"] > 0 and a["exchanges"] == a["layers"] * a["steps"]
    forwards = a["steps"] - a["idle_steps"]  # idle (zero-token) steps are not forwards; they are never split
    if n > 1 and not unsplit:
        assert forwards < a["micro_batches"] <= n * forwards, "no step was split"
    else:
        assert a["micro_batches"] == forwards
    expected = a["layers"] * (n * a["steps"] if padded else a["micro_batches"] + a["idle_steps"])
    assert a["messages_sent"] == a["messages_received"] == expected
    if ffn is not None:
        f = ffn["stats"][0]
        assert f["ffn_batches"] == f["messages_received"] == a["messages_sent"]


@pytest.mark.parametrize("family,n", [(family, n) for family in sorted(set(ARCH) - set(PLAIN_CANNOT_RUN))
                                      for n in (1, 2, 3)])
def test_micro_batches_match_plain_vllm(workdir: Path, family: str, n: int) -> None:
    """N = 1 is AFD's default: the pair of test_afd_e2e's 1A1F test, shared (started here when that test did not
    run in this session)."""
    if n == 1:
        plain, ffn, attn = pair_1a1f(workdir, family)
    else:
        model, plain = _model_and_plain(workdir, family)
        afd = _micro(_afd(1), n)
        ffn, attn = _run_engines([
            _spec(f"{family}-ub{n}-ffn", "ffn", model, family, {**afd, "role": "ffn"}),
            _spec(f"{family}-ub{n}-attn", "attention", model, family, {**afd, "role": "attention"}),
        ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, n, unsplit=family in UNSPLIT)


@pytest.mark.parametrize("family,schedule", [
    ("llama", "batched"), ("llama", "pingpong"),
    ("qwen3_moe", "batched"),
    ("qwen3_moe", "pingpong")])
def test_2a1f_micro_batches_match_plain_vllm(workdir: Path, family: str, schedule: str) -> None:
    """Two attention ranks, two micro-batches each, one FFN rank. Batched: the FFN rank batches micro-batch k
    of every rank (a step too small to split sends an empty second micro-batch, so every rank sends the same
    messages per layer); pingpong: it serves each message as it arrives."""
    model, plain = _model_and_plain(workdir, family)
    afd = _micro(_afd(2, schedule), 2)
    flags = [str(workdir / f"ub-2a-{family}-{schedule}-done-{r}") for r in range(2)]
    for f in flags:
        Path(f).unlink(missing_ok=True)
    specs = [_spec(f"{family}-ub-2a-{schedule}-ffn", "ffn", model, family, {**afd, "role": "ffn"})]
    for r in range(2):
        spec = _spec(f"{family}-ub-2a-{schedule}-attn{r}", "attention", model, family,
                     {**afd, "role": "attention", "rank": r})
        spec.update(done_flag=flags[r], wait_for=flags)
        specs.append(spec)
    ffn, *attns = _run_engines(specs, workdir, stagger_s=1.0)
    for attn in attns:
        _assert_same_outputs(plain, attn)
        _check_split(attn, None, 2, padded=schedule == "batched")
    f = ffn["stats"][0]
    assert f["messages_received"] == f["messages_sent"] == sum(a["stats"][0]["messages_sent"] for a in attns)


def test_compiled_micro_batches_match_plain_vllm_compiled(workdir: Path) -> None:
    """At vLLM's default compilation the micro-batch threads run the compiled attention model (dynamo +
    inductor around ``afd::exchange``); exact against plain vLLM compiled the same way. The FFN role runs its
    modules eagerly by default (``compile_ffn`` off)."""
    family = "llama"
    model = _model(workdir, family)
    afd = _micro(_afd(1), 2)
    plain, ffn, attn = _run_engines([
        _spec(f"{family}-ub-plain-compiled", "plain", model, family, compiled=True),
        _spec(f"{family}-ub2c-ffn", "ffn", model, family, {**afd, "role": "ffn"}, compiled=True),
        _spec(f"{family}-ub2c-attn", "attention", model, family, {**afd, "role": "attention"}, compiled=True),
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, 2)
    assert ffn["stats"][0]["ffn_compile_s"] == 0  # compile_ffn is off by default


MIXED_PROMPTS = [[(5 * j) % 500 + 1 for j in range(40)], [5, 300, 211, 64], [9, 8, 7, 6, 5]]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_mixed_prefill_decode_steps_split_exactly(workdir: Path, family: str) -> None:
    """With ``max_num_batched_tokens=16`` the 40-token prompt is prefilled in chunks while the short ones
    already decode, so steps mix prefill chunks and decodes, and a micro-batch boundary falls inside a
    request (vLLM's slices split it); two micro-batches stay exact against plain vLLM on the same settings."""
    model = _model(workdir, family)
    settings = {"prompts": MIXED_PROMPTS, "max_num_batched_tokens": 16}
    afd = _micro(_afd(1), 2)
    plain, ffn, attn = _run_engines([
        {**_spec(f"{family}-mixed-plain", "plain", model, family), **settings},
        {**_spec(f"{family}-mixed-ffn", "ffn", model, family, {**afd, "role": "ffn"}), **settings},
        {**_spec(f"{family}-mixed-attn", "attention", model, family, {**afd, "role": "attention"}), **settings},
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, 2)


def test_three_micro_batches_over_a_delayed_link_stay_exact(workdir: Path) -> None:
    """Issue 49: the attention engine reaches the FFN through a relay that holds every byte 1 ms each way
    (``harness.delay_link``: messages of several micro-batches in flight at once, as on a long link). Three
    micro-batches stay exact against plain vLLM (tokens, top-5 logprobs), every step's micro-batches were answered,
    and the relay did hold what it carried."""
    family = "llama"
    model, plain = _model_and_plain(workdir, family)
    afd = _micro(_afd(1), 3)
    afd["connector_extra_config"]["backend"] = "tcp"  # the tensors go through the session socket: the relay
    link = DelayLink(("127.0.0.1", afd["port"]), 0.001)
    try:
        ffn, attn = _run_engines([
            _spec(f"{family}-delayed-ffn", "ffn", model, family, {**afd, "role": "ffn"}),
            _spec(f"{family}-delayed-attn", "attention", model, family,
                  {**afd, "role": "attention", "port": link.port}),
        ], workdir, stagger_s=1.0)
        chunks, least_held = link.stats()
    finally:
        link.close()
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, 3)
    assert chunks >= attn["stats"][0]["messages_sent"] and least_held >= 0.001
