#!/usr/bin/env bash
# Install (if needed), then run the main job: a tiny model on real vLLM with and without the plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m scripts.demo "$@"
