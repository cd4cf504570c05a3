"""What scripts/compose_check.sh asks of a running compose stack, through its published ports only.

Each subcommand prints one line saying what it saw, or `FAILED: why` and exits 1. Standard library
only: it runs with the host's python3 before any virtual environment exists.
  healthy URL TIMEOUT_S                 wait for 200; print the seconds it took
  first API TIMEOUT_S                   retry a first P-MD answer until one comes (KV path warm)
  chat API PIPELINE [TIERS]             one answer on PIPELINE; every tier in TIERS took part
  trace API                             one request's trace on /dashboard has spans of all four roles
  wan-moves API CONTROL                 a P-RLD-MD request moves the WAN emulator's /stats
  recovery API KILL_COMMAND             kill MD mid-stream: the answer still completes, token-exact
  relays API N                          the gateway hears N RLD instances and uses each
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

PROMPT = [{"role": "user", "content": "Count from one to a hundred, in words."}]
ROLES = ("gateway", "prefill", "relay", "main")


class ProbeFailed(Exception):
    pass


def http(url: str, body: dict | None = None, timeout_s: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise ProbeFailed(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from e
    except OSError as e:
        raise ProbeFailed(f"{url}: {e}") from e


def chat(api: str, pipeline: str, max_tokens: int = 24, **pdd: object) -> dict:
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "pdd": {"pipeline": pipeline, **pdd}}
    return http(f"{api}/v1/chat/completions", body)


def stream(api: str, pipeline: str, max_tokens: int) -> Iterator[dict]:
    """The chunks of a streamed answer, as they come."""
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "pdd": {"pipeline": pipeline}}
    request = urllib.request.Request(f"{api}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if "error" in chunk:
                raise ProbeFailed(f"error event mid-stream: {chunk['error']}")
            yield chunk


def stream_token_ids(chunks: Iterator[dict], on_token: Callable[[int], None] | None = None) -> tuple[list[int], dict]:
    ids: list[int] = []
    last: dict = {}
    for chunk in chunks:
        for token in (chunk.get("pdd") or {}).get("tokens") or []:
            ids.append(token["id"])
            if on_token is not None:
                on_token(len(ids))
        last = chunk
    return ids, last


def healthy(url: str, timeout_s: str) -> str:
    began = time.monotonic()
    deadline = began + float(timeout_s)
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    return f"{url} healthy after {time.monotonic() - began:.0f} s"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
        except OSError as e:
            last = str(e)
        time.sleep(1)
    raise ProbeFailed(f"{url} not healthy within {timeout_s} s (last: {last})")


def first_answer(api: str, timeout_s: str) -> str:
    """/healthz says every role answers over NATS; the KV path (through the WAN) may lag behind it."""
    began = time.monotonic()
    failures: list[str] = []
    while True:
        try:
            chat(api, "p-md", max_tokens=2)
            break
        except ProbeFailed as e:
            failures.append(str(e))
            if time.monotonic() - began > float(timeout_s):
                raise ProbeFailed(f"no answer within {timeout_s} s: {failures[-1]}") from e
            time.sleep(2)
    tried = f", after {len(failures)} failed: {failures[0][-120:]}" if failures else ""
    return f"first answer {time.monotonic() - began:.1f} s after healthy{tried}"


def check_chat(api: str, pipeline: str, tiers: str = "") -> str:
    # On P-RLD-MD, RLD hands off at once when MD holds the prompt already: ask for a later cut.
    answer = chat(api, pipeline, **({"handoff_at": 6} if pipeline == "p-rld-md" else {}))
    text = answer["choices"][0]["message"]["content"]
    pdd = answer.get("pdd") or {}
    by_tier = pdd.get("tokens_by_tier") or {}
    if not text:
        raise ProbeFailed(f"{pipeline}: empty answer: {answer}")
    if pdd.get("pipeline") != pipeline:
        raise ProbeFailed(f"asked for {pipeline}, pdd.pipeline is {pdd.get('pipeline')!r}")
    missing = [t for t in tiers.split(",") if t and not by_tier.get(t)]
    if missing:
        raise ProbeFailed(f"{pipeline}: no tokens from {missing}: tokens_by_tier {by_tier}")
    return f"{pipeline}: {answer['usage']['completion_tokens']} tokens, by tier {by_tier}: {text[:40]!r}"


def check_trace(api: str) -> str:
    trace_id = chat(api, "p-rld-md")["pdd"]["trace_id"]
    seen: set[str] = set()
    deadline = time.monotonic() + 30  # services export their spans in batches, every few seconds
    while time.monotonic() < deadline:
        try:
            timeline = http(f"{api}/dashboard/api/traces/{trace_id}")
        except ProbeFailed:
            timeline = {}
        seen = {role for role in ROLES if f'"{role}' in json.dumps(timeline)}
        if seen == set(ROLES):
            return f"trace {trace_id}: spans from {', '.join(ROLES)}"
        time.sleep(1)
    raise ProbeFailed(f"trace {trace_id} on /dashboard has spans of {sorted(seen)} only, not all of {ROLES}")


def wan_total(control: str) -> int:
    stats = http(f"{control}/stats")
    return sum(v for k, v in _numbers(stats) if k.endswith("bytes"))


def _numbers(value: object, key: str = "") -> Iterator[tuple[str, int]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v, key)
    elif isinstance(value, int) and not isinstance(value, bool):
        yield key, value


def check_wan_moves(api: str, control: str) -> str:
    before = wan_total(control)
    chat(api, "p-rld-md")
    after = wan_total(control)
    if after <= before:
        raise ProbeFailed(f"{control}/stats: bytes did not move across a P-RLD-MD request ({before} -> {after})")
    return f"WAN /stats: {after - before} bytes moved by one P-RLD-MD request"


def check_recovery(api: str, kill_command: str, max_tokens: str = "400") -> str:
    """A P-MD answer streams from MD; killing MD migrates it (docs/policy.md, "Failures")."""
    reference, _ = stream_token_ids(stream(api, "p-md", int(max_tokens)))
    killed_at: list[int] = []

    def kill_after_a_few(count: int) -> None:
        if count == 8 and not killed_at:
            killed_at.append(count)
            subprocess.run(kill_command, shell=True, check=True, capture_output=True, timeout=30)

    began = time.monotonic()
    ids, last = stream_token_ids(stream(api, "p-md", int(max_tokens)), kill_after_a_few)
    took_s = time.monotonic() - began
    if not killed_at:
        raise ProbeFailed(f"the answer ended ({len(ids)} tokens) before MD could be killed")
    if ids != reference:
        first = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
        raise ProbeFailed(f"after the kill the answer differs from the reference at token {first} "
                          f"({len(ids)} tokens, reference {len(reference)})")
    recovery = (last.get("pdd") or {}).get("recovery") or (last.get("pdd") or {}).get("recoveries")
    return (f"MD killed after {killed_at[0]} tokens: the answer completed token-exact "
            f"({len(ids)} tokens in {took_s:.1f} s; recovery {json.dumps(recovery)})")


def check_relays(api: str, count: str) -> str:
    """The gateway hears N RLDs, then requests two at a time land on N different ones."""
    want = int(count)
    deadline = time.monotonic() + 180
    heard = 0
    while heard < want:
        if time.monotonic() > deadline:
            raise ProbeFailed(f"the gateway heard {heard} RLD instances within 180 s, not {want}")
        try:
            with urllib.request.urlopen(f"{api}/healthz", timeout=3) as response:
                heard = json.loads(response.read())["instances"]["relay"]
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(1)
    seen: set[str] = set()
    for _ in range(10):
        with ThreadPoolExecutor(want) as pool:
            answers = list(pool.map(lambda _: chat(api, "p-rld-md", max_tokens=32, handoff_at=24), range(want)))
        seen |= {str(a["pdd"]["instances"].get("relay")) for a in answers}
        if len(seen) >= want:
            return f"the gateway heard {heard} RLD instances and used {len(seen)}: {sorted(seen)}"
    raise ProbeFailed(f"P-RLD-MD requests used RLD instances {sorted(seen)} only, not {want} different ones")


COMMANDS: dict[str, Callable[..., str]] = {
    "healthy": healthy, "first": first_answer, "chat": check_chat, "trace": check_trace,
    "wan-moves": check_wan_moves, "recovery": check_recovery, "relays": check_relays}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(COMMANDS[argv[0]](*argv[1:]))
    except (ProbeFailed, KeyError, subprocess.SubprocessError) as e:
        print(f"FAILED: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
