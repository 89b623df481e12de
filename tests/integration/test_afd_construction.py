"""Bytes allocated while each AFD role builds its model, on real vLLM, for every AFD architecture.

One subprocess for every selected family (``harness/construction_bytes.py``) builds each
FFN-heavy tiny checkpoint's model three times with vLLM's own loader and config
objects -- plain, attention role, FFN role -- each under a ``TorchDispatchMode``
allocation counter (all devices), without loading weights or starting an engine.

Checks, per family: the MLP/experts are >= 90 % of the parameters; the counter
sees the plain model's parameters; the attention role allocates at most its
non-FFN parameter bytes + 5 % and holds exactly the plain model's non-FFN
parameter bytes, with no FFN module in vLLM's forward context; the FFN role
allocates at most its FFN parameter bytes + 5 % and holds exactly those.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from harness.construction_bytes import FFN_PARAM
from harness.engine import ARCH
from harness.env import REPO, vllm_env
from harness.tiny_model import build

pytestmark = pytest.mark.vllm

SLACK = 1.05


TEST = "test_each_role_allocates_only_its_own_parameters"


@pytest.fixture(scope="module")
def measured(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every selected family measured in two subprocesses side by side, half of the families each (``import
    vllm`` twice, not once per family; on a fresh checkout vLLM inspects each new architecture in a subprocess of
    its own, one after the other, so two halves use both cores; ``-k family`` builds only that family's models):
    ``"family/role"`` -> result."""
    work = tmp_path_factory.mktemp("afd-construction")
    families = sorted({item.callspec.params["family"] for item in request.session.items
                       if getattr(item, "originalname", "") == TEST and hasattr(item, "callspec")})
    models = [f"{family}={build(work / family, family, wide=True)}" for family in families]
    procs = [subprocess.Popen([sys.executable, "-m", "harness.construction_bytes", *half], env=vllm_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for half in (models[0::2], models[1::2]) if half]
    outputs = [proc.communicate(timeout=1800) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, (out + err)[-4000:]
    rows = [json.loads(line[len("RESULT "):]) for out, _ in outputs for line in out.splitlines()
            if line.startswith("RESULT ")]
    return {f"{r['family']}/{r['role']}": r for r in rows}


@pytest.mark.parametrize("family", sorted(ARCH))
def test_each_role_allocates_only_its_own_parameters(measured: dict[str, dict[str, Any]], family: str) -> None:
    plain, attn, ffn_role = (measured[f"{family}/{role}"] for role in ("plain", "attention", "ffn"))
    ffn, non_ffn = plain["plain_ffn_params"], plain["plain_non_ffn_params"]
    assert ffn >= 0.9 * (ffn + non_ffn), f"{family}: the FFN-heavy model is not FFN-heavy ({ffn} of {ffn + non_ffn})"
    assert plain["allocated"] >= ffn + non_ffn == plain["params_held"]  # the counter sees every parameter

    assert attn["params_held"] == non_ffn
    assert attn["allocated"] <= SLACK * non_ffn, f"{family} attention role allocated {attn['allocated']} bytes"
    assert attn["forward_context"] and not [k for k in attn["forward_context"] if FFN_PARAM.search(f"{k}.")]

    assert ffn_role["params_held"] == ffn
    assert ffn_role["allocated"] <= SLACK * ffn, f"{family} FFN role allocated {ffn_role['allocated']} bytes"
    print(f"{family}: attention role allocated {attn['allocated'] / non_ffn:.3f}x its non-FFN parameters, "
          f"FFN role {ffn_role['allocated'] / ffn:.3f}x its FFN parameters")
