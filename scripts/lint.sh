#!/usr/bin/env bash
# The checks CI runs beside the tests: ruff (rules in pyproject.toml's [tool.ruff]) over the code and
# tests, mypy ([tool.mypy]) over shared/ and services/. Exits non-zero on any finding.
# Needs .venv with the test extra (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

RUFF=.venv/bin/ruff
MYPY=.venv/bin/mypy
for tool in "$RUFF" "$MYPY"; do
  if [[ ! -x "$tool" ]]; then
    echo "lint: $tool is missing; run scripts/setup.sh (ruff and mypy are in the test extra)" >&2
    exit 2
  fi
done

ruff_status=0
"$RUFF" check shared services tools wan scripts tests || ruff_status=$?
mypy_status=0
"$MYPY" shared services || mypy_status=$?

verdict() { if [[ $1 -eq 0 ]]; then echo "clean"; else echo "FAILED (exit $1)"; fi; }
echo "lint: ruff $(verdict "$ruff_status"), mypy $(verdict "$mypy_status")"
[[ $ruff_status -eq 0 && $mypy_status -eq 0 ]]
