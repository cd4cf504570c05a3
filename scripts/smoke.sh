#!/usr/bin/env bash
# The newcomer's path, as README's "Quick start" and "Running it" show it: ./dev.sh demo (tiny, then
# SmolLM2), pdd up with the README's curl and an openai client call, pdd up --topology two-dc with
# one P-RLD-MD request, and docs/benchmarks.md's quick `pdd bench`. Each must exit 0 and print what
# the README says it prints. Beyond the README's commands: a free port (--port 0) and logs in a
# temporary directory (--log-dir), so a stack already on port 8000 does not get in the way.
# Usage: scripts/smoke.sh   (from anywhere; logs stay in $SMOKE_DIR, default a fresh /tmp dir)
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d -t pdd-smoke.XXXXXX)}  # if given: a new or empty directory
mkdir -p "$SMOKE_DIR"
SMOKE_DIR=$(cd "$SMOKE_DIR" && pwd)
if [ -n "$(ls -A "$SMOKE_DIR")" ]; then echo "smoke: $SMOKE_DIR is not empty" >&2; exit 2; fi
PY=.venv/bin/python
PDD=.venv/bin/pdd
STACK_PID=""       # the `pdd up` running now, if any
STACK_CODE=0       # its exit code, once stopped
STEP=""            # the step running now, for the failure message
STEP_LOG=""        # the output to show when it fails
STEP_LOG_DIR=""    # the services' logs to show when it fails
STEP_BEGAN=0
SMOKE_BEGAN=$SECONDS

say() { echo "smoke: $*"; }

step() {  # step NAME OUTPUT_FILE [SERVICE_LOG_DIR]
  STEP=$1 STEP_LOG=$2 STEP_LOG_DIR=${3:-} STEP_BEGAN=$SECONDS
  say "$STEP ..."
}

ok() { say "$STEP ok ($((SECONDS - STEP_BEGAN)) s)"; STEP=""; }

fail() {
  echo "smoke: $STEP FAILED: $*" >&2
  if [ -n "$STEP_LOG" ] && [ -f "$STEP_LOG" ]; then
    echo "--- last 40 lines of $STEP_LOG" >&2
    tail -n 40 "$STEP_LOG" >&2
  fi
  if [ -n "$STEP_LOG_DIR" ] && [ -d "$STEP_LOG_DIR" ]; then
    for log in "$STEP_LOG_DIR"/*.log; do
      [ -f "$log" ] || continue
      echo "--- last 15 lines of $log" >&2
      tail -n 15 "$log" >&2
    done
  fi
  echo "smoke: logs in $SMOKE_DIR" >&2
  exit 1
}

expect() {  # expect FILE EXTENDED_REGEX WHAT: FILE must have a line matching the regex
  grep -Eq -- "$2" "$1" || fail "no $3 in $1 (wanted a line matching /$2/)"
}

exited_ok() {  # exited_ok CODE DEADLINE_S: a command run under `timeout` exited 0
  [ "$1" -ne 124 ] || fail "still running after its $2 s deadline"
  [ "$1" -eq 0 ] || fail "exit code $1"
}

alive() { kill -0 "$1" 2>/dev/null; }

services_in() {  # services_in DIR: the processes whose stdout is a log under DIR (the launcher's children)
  local fd
  for fd in /proc/[0-9]*/fd/1; do
    case "$(readlink "$fd" 2>/dev/null)" in "$1"/*) fd=${fd#/proc/}; echo "${fd%%/*}" ;; esac
  done
}

stop_stack() {  # stop_stack SIGNAL DEADLINE_S: signal `pdd up`, wait for it to exit; sets STACK_CODE
  local pid=$STACK_PID waited=0
  STACK_CODE=0
  [ -n "$pid" ] || return 0
  kill -s "$1" "$pid" 2>/dev/null || true
  while alive "$pid" && [ "$waited" -lt "$2" ]; do sleep 1; waited=$((waited + 1)); done
  if alive "$pid"; then
    kill -s "$1" "$pid" 2>/dev/null || true  # a second Ctrl-C kills everything at once
    sleep 2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" || STACK_CODE=$?
  STACK_PID=""
}

cleanup() {
  local code=$? pid
  trap - EXIT INT TERM
  stop_stack TERM 30 || true
  for pid in $(services_in "$SMOKE_DIR"); do kill -KILL "$pid" 2>/dev/null || true; done
  if [ "$code" -ne 0 ] && [ -n "$STEP" ]; then
    echo "smoke: stopped during $STEP (exit $code); logs in $SMOKE_DIR" >&2
  fi
  exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

demo() {  # demo NAME DEADLINE_S [pdd demo flags]: ./dev.sh demo as a user types it
  local name=$1 deadline_s=$2 out="$SMOKE_DIR/$1.out" code=0
  shift 2
  step "$name: ./dev.sh demo${*:+ $*}" "$out" "$SMOKE_DIR/$name"
  timeout --foreground -k 20 "$deadline_s" ./dev.sh demo "$@" --port 0 --log-dir "$SMOKE_DIR/$name" \
    </dev/null >"$out" 2>&1 || code=$?
  exited_ok "$code" "$deadline_s"
  expect "$out" '^\[RLD\]' "answer marked [RLD]"
  expect "$out" '^summary$' "summary block"
  expect "$out" '^  pipeline +p-rld-md$' "summary pipeline line"
  expect "$out" '^  TTFT +[0-9]+ ms$' "summary TTFT line"
  expect "$out" '^  tokens/s +' "summary tokens/s line"
  expect "$out" '^  tokens +[0-9]+ in ' "summary tokens line"
  expect "$out" '^  handoff +(after [0-9]+ eager tokens|none)' "summary handoff line"
  expect "$out" 'pdd stack stopped in .*killed: none\)' "clean stack stop"
  local left
  left=$(services_in "$SMOKE_DIR/$name")
  [ -z "$left" ] || fail "processes left behind: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
}

start_stack() {  # start_stack NAME DEADLINE_S [pdd up flags]: `pdd up` in the background until healthy
  local name=$1 deadline_s=$2 out="$SMOKE_DIR/$1.out"
  shift 2
  step "$name: pdd up${*:+ $*}" "$out" "$SMOKE_DIR/$name"
  "$PDD" up "$@" --port 0 --log-dir "$SMOKE_DIR/$name" </dev/null >"$out" 2>&1 &
  STACK_PID=$!
  local until=$((SECONDS + deadline_s))
  API_URL=""
  while [ -z "$API_URL" ]; do
    alive "$STACK_PID" || fail "pdd up exited before it was ready"
    [ "$SECONDS" -lt "$until" ] || fail "not ready within $deadline_s s"
    sleep 1
    API_URL=$(sed -nE 's|^pdd: ready\. OpenAI API at (http://[^ ]+)/v1 .*|\1|p' "$out")
  done
  until curl -sf --max-time 5 "$API_URL/healthz" >/dev/null; do
    [ "$SECONDS" -lt "$until" ] || fail "$API_URL/healthz not ok within $deadline_s s"
    sleep 1
  done
  PORT=${API_URL##*:}
}

check_stack_stops() {  # check_stack_stops NAME: Ctrl-C, as README says; exit 0 and every service gone
  local out="$SMOKE_DIR/$1.out" left
  STEP_LOG=$out
  stop_stack INT 60
  [ "$STACK_CODE" -eq 0 ] || fail "pdd up exited $STACK_CODE on Ctrl-C (SIGINT)"
  expect "$out" '^pdd: SIGINT: stopping' "Ctrl-C line"
  expect "$out" 'pdd stack stopped in .*killed: none\)' "clean stack stop"
  left=$(services_in "$SMOKE_DIR/$1")
  [ -z "$left" ] || fail "processes left behind: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
}

check_sse() {  # check_sse FILE: a well-formed chat completion stream with text, a finish and tiers
  "$PY" - "$1" <<'EOF' || fail "malformed stream in $1"
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("data: ")]
assert lines and lines[-1] == "data: [DONE]", "the stream does not end with data: [DONE]"
chunks = [json.loads(l[len("data: "):]) for l in lines[:-1]]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
tiers = {t["tier"] for c in chunks for t in c.get("pdd", {}).get("tokens", [])}
assert all(c["object"] == "chat.completion.chunk" for c in chunks), "a chunk is not a chat.completion.chunk"
assert text.strip(), "no text"
assert finish, "no finish_reason"
assert tiers, "no token tiers in the pdd field"
print(f"smoke:   {len(chunks)} chunks, finish {finish[-1]}, tiers {sorted(tiers)}: {text!r}")
EOF
}

openai_call() {  # openai_call BASE_URL: the openai client, as "Any OpenAI client works" promises
  "$PY" - "$1" <<'EOF' || fail "openai client call failed"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", timeout=120, max_retries=0)
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, max_tokens=32,
                                       messages=[{"role": "user", "content": "Hi"}])
text = reply.choices[0].message.content
assert reply.object == "chat.completion" and text and text.strip(), f"empty answer: {reply}"
assert reply.usage.completion_tokens > 0, f"no completion tokens: {reply.usage}"
assert reply.model_extra["pdd"]["pipeline"], f"no pdd object: {reply}"
print(f"smoke:   openai: {model}, {reply.usage.completion_tokens} tokens, "
      f"finish {reply.choices[0].finish_reason}: {text!r}")
EOF
}

pipeline_request() {  # pipeline_request BASE_URL PIPELINE: one request that names its pipeline
  "$PY" - "$1" "$2" <<'EOF' || fail "the $2 request failed or its pdd field is wrong"
import json, sys, urllib.request
url, pipeline = sys.argv[1], sys.argv[2]
body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "pdd": {"pipeline": pipeline}}
req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as resp:
    reply = json.load(resp)
pdd = reply["pdd"]
tiers = pdd["tokens_by_tier"]
assert reply["choices"][0]["message"]["content"].strip(), "no text"
assert pdd["pipeline"] == pipeline, f"pdd.pipeline is {pdd['pipeline']!r}"
assert set(tiers) <= {"prefill", "relay", "main"}, f"unknown tiers: {tiers}"  # how many RLD makes is timing
assert sum(tiers.values()) == reply["usage"]["completion_tokens"], f"{tiers} vs {reply['usage']}"
print(f"smoke:   pdd.pipeline {pdd['pipeline']}, tokens by tier {tiers}, handoff {pdd.get('handoff')}")
EOF
}

say "logs in $SMOKE_DIR"
step "setup: scripts/setup.sh" "$SMOKE_DIR/setup.out"
scripts/setup.sh >"$SMOKE_DIR/setup.out" 2>&1 || fail "exit code $?"
ok

demo demo-tiny 300 --model tiny
ok

demo demo-smollm2 600
expect "$SMOKE_DIR/demo-smollm2.out" '\[MD\]' "answer marked [MD]"
expect "$SMOKE_DIR/demo-smollm2.out" '\|handoff (after [0-9]+ eager tokens|to MD)' "handoff mark in the answer"
expect "$SMOKE_DIR/demo-smollm2.out" '^  handoff +after [0-9]+ eager tokens' "summary handoff line"
ok

start_stack up 300
expect "$SMOKE_DIR/up.out" "^pdd: ready\. OpenAI API at http://.*/v1 \(health: " "ready line"
STEP_LOG="$SMOKE_DIR/up-curl.out"
curl -N localhost:"$PORT"/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":32,"stream":true}' \
  --max-time 120 -sS --fail-with-body >"$STEP_LOG" 2>&1 || fail "curl failed"
check_sse "$STEP_LOG"
STEP_LOG="$SMOKE_DIR/up.out"
openai_call "$API_URL/v1"
check_stack_stops up
ok

start_stack up-two-dc 300 --topology two-dc --wan-bandwidth-mbps 100 --wan-delay-ms 15
expect "$SMOKE_DIR/up-two-dc.out" \
  '^pdd: two datacenters: MD in B behind the WAN emulator \(100 Mbit/s, 15 ms one way' "two-datacenter line"
pipeline_request "$API_URL" p-rld-md
check_stack_stops up-two-dc
ok

step "bench: pdd bench --model tiny --max-requests 8" "$SMOKE_DIR/bench.out"
code=0
timeout --foreground -k 20 600 "$PDD" bench --model tiny --max-requests 8 --out "$SMOKE_DIR/bench" --no-progress \
  </dev/null >"$SMOKE_DIR/bench.out" 2>&1 || code=$?
exited_ok "$code" 600
[ -s "$SMOKE_DIR/bench/summary.md" ] || fail "no $SMOKE_DIR/bench/summary.md"
expect "$SMOKE_DIR/bench.out" '^pdd bench: wrote .*/summary\.md' "line naming summary.md"
expect "$SMOKE_DIR/bench.out" '^pdd bench: [^ ]+__pdd: 8/8 requests in ' "pdd mode run"
awk '/^pdd bench: .* requests in / { split($4, n, "/"); if (n[1] != n[2]) bad = 1; runs++ }
     END { exit (bad || runs == 0) }' "$SMOKE_DIR/bench.out" || fail "a mode lost requests (done/sent)"
for run in "$SMOKE_DIR"/bench/*__*/; do
  [ -s "$run/results.json" ] || fail "no results.json in $run"
done
ok

say "all ok in $((SECONDS - SMOKE_BEGAN)) s (logs in $SMOKE_DIR)"
