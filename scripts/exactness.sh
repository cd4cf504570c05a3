#!/usr/bin/env bash
# The exactness tests (`pytest -m exactness`: packed and planned linears, the CPU attention kernel,
# bfloat16 decoders token-exact through both pipelines) again as other CPUs would run them:
# oneDNN capped to AVX2 and to AVX-512 without BF16 (ONEDNN_MAX_CPU_ISA), and the attention kernel
# built for AVX2 and for AVX-512 (PDD_CPU_ATTENTION_MARCH). A cap above this CPU's own is skipped,
# and said so. The suite itself (./dev.sh test) runs them on the machine's best.
# Usage: scripts/exactness.sh [pytest args]   (needs .venv: scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider "$@")
has() { grep -qw "$1" /proc/cpuinfo; }
failed=()

run() {  # run LABEL ENV... -- PYTEST ARGS
  local label=$1; shift
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  echo "exactness: $label"
  if ! env "${envs[@]}" "${PYTEST[@]}" "$@"; then failed+=("$label"); fi
}

run "oneDNN capped to AVX2" ONEDNN_MAX_CPU_ISA=AVX2 -- -m exactness
if has avx512bw && has avx512vl && has avx512dq; then
  run "oneDNN capped to AVX-512 without BF16" ONEDNN_MAX_CPU_ISA=AVX512_CORE -- -m exactness
  run "attention kernel built for AVX-512 (x86-64-v4)" PDD_CPU_ATTENTION_MARCH=x86-64-v4 -- tests/test_cpu_attention.py
else
  echo "exactness: this CPU has no AVX-512: its caps and the x86-64-v4 kernel are not run here"
fi
if has avx2 && has fma && has bmi2; then
  run "attention kernel built for AVX2 (x86-64-v3)" PDD_CPU_ATTENTION_MARCH=x86-64-v3 -- tests/test_cpu_attention.py
fi

if (( ${#failed[@]} )); then
  printf 'exactness: FAILED under: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "exactness: passed under every cap this CPU allows"
