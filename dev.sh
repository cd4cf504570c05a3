#!/usr/bin/env bash
# The two commands a new user runs: `./dev.sh demo` (start a local stack, stream one answer marked
# by tier, stop) and `./dev.sh test` (the test suite). Both set up .venv first, once.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  echo "usage: ./dev.sh demo [pdd demo flags, e.g. --model tiny --prompt '...']" >&2
  echo "       ./dev.sh test [pytest args, e.g. -k launcher]" >&2
}

case "${1:-}" in
  demo)
    shift
    scripts/setup.sh
    exec .venv/bin/pdd demo "$@"
    ;;
  test)
    shift
    scripts/setup.sh
    exec .venv/bin/python -m pytest -q "$@"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
