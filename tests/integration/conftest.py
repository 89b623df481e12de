"""Real-vLLM fixtures: a tiny checkpoint built here.

These tests need vLLM (the CPU build) importable. They do not skip when it is
missing: they fail, loudly, because a green run without vLLM would prove nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from vllm_run import REPO


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - must fail, not skip
        pytest.fail(f"real-vLLM tests need vLLM installed (see README): {exc}")
    from tiny_model import build

    return build(REPO / ".cache" / "models" / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with a tiny word-level tokenizer, for the OpenAI-server tests."""
    from tiny_model import build
    from tiny_tokenizer import build_tokenizer

    path = build(tmp_path_factory.mktemp("afd-server") / "tiny-llama", "llama")
    return build_tokenizer(path, vocab_size=512)


@pytest.fixture(scope="session")
def plain_generation(model_dir: Path) -> Any:
    """Plain offline vLLM on ``model_dir``: greedy token ids and top-5 logprobs for the servers' prompt."""
    from test_afd_server import MAX_TOKENS, PROMPT, START_TIMEOUT_S
    from vllm_run import run_generate

    plain = run_generate(model_dir, "--prompts", " ".join(map(str, PROMPT)), "--max-tokens", str(MAX_TOKENS),
                         timeout=START_TIMEOUT_S)
    assert plain.returncode == 0 and plain.result, plain.output[-3000:]
    return plain
