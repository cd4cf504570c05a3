#!/usr/bin/env bash
# The two commands a new user runs: `./dev.sh demo` (start a local stack, stream one answer marked
# by tier, stop) and `./dev.sh test` (the test suite). Both set up .venv first, once.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  echo "usage: ./dev.sh demo [pdd demo flags, e.g. --model tiny --prompt '...']" >&2
  echo "       ./dev.sh test [pytest args, e.g. -k launcher; -n 0 for one worker]" >&2
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
    # Two workers, each taking whole test files (a module's stack stays in one worker): most of a
    # stack test is waiting on processes, so two overlap well even on two cores. -n 0 runs serially.
    exec .venv/bin/python -m pytest -q -n "${PDD_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
