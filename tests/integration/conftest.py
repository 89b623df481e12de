"""Real-vLLM fixtures: tiny checkpoints built here (harness/tiny_model.py).

These tests need vLLM (the CPU build) importable. They do not skip when it is
missing: they fail, loudly, because a green run without vLLM would prove nothing.

``model_infos`` (autouse): vLLM's model-inspection cache filled for the tiny families once per session, before the
first engine starts (``harness.model_infos``: one process instead of one per architecture and engine).

``front_end``: the front-end refusals of every selected module (its ``front_end_cases(model)``) checked in one
process (``harness.config_probe``), not one vLLM front end per case.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import model_infos as infos
from harness import starts
from harness.config_probe import Probe, probe
from harness.engine import Generation, generate
from harness.env import REPO


@pytest.fixture(scope="session", autouse=True)
def model_infos() -> None:
    """vLLM's model-inspection cache filled once per session (every pytest-xdist worker asks; the first fills it)."""
    printed = infos.warm_once(Path(os.environ[starts.ENV]))
    if printed:
        print(printed.strip())


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - must fail, not skip
        pytest.fail(f"real-vLLM tests need vLLM installed (see README): {exc}")
    from harness.tiny_model import build

    return build(REPO / ".cache" / "models" / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with a tiny word-level tokenizer, for the OpenAI-server tests."""
    from harness.tiny_model import build
    from harness.tiny_tokenizer import build_tokenizer

    path = build(tmp_path_factory.mktemp("afd-server") / "tiny-llama", "llama")
    return build_tokenizer(path, vocab_size=512)


@pytest.fixture(scope="session")
def plain_generation(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Generation:
    """Plain offline vLLM on ``model_dir``: greedy token ids and top-5 logprobs for the servers' prompt."""
    from tests.integration.test_afd_server import LOGPROBS, MAX_TOKENS, PROMPT, START_TIMEOUT_S

    plain = generate(model_dir, tmp_path_factory.mktemp("plain-generation"), prompts=[PROMPT],
                     max_tokens=MAX_TOKENS, logprobs=LOGPROBS, timeout_s=START_TIMEOUT_S)
    assert plain.returncode == 0 and plain.result, plain.output[-3000:]
    return plain


@pytest.fixture(scope="session")
def front_end(request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Probe:
    """The cases ``front_end_cases(tiny_llama)`` of every module with selected tests, in one probe process
    (``harness.config_probe``: vLLM's config step only, the plugin loaded, ``AFD_TOKEN`` unset); results by
    case name (unique across modules)."""
    modules = {getattr(item, "module", None) for item in request.session.items}
    cases = [case for module in sorted((m for m in modules if hasattr(m, "front_end_cases")), key=lambda m: m.__name__)
             for case in module.front_end_cases(tiny_llama)]
    return probe(cases, tmp_path_factory.mktemp("front-end"), unset=("AFD_TOKEN",))
