"""The requests a benchmark sends: agentic multi-turn sessions, the Mooncake trace, fixed-length ones.

A workload is a plan, fixed by its seed: arrival times, the token ids each request adds, output
lengths, and the prefix an unbounded cache would hold when it arrives. A session's turn adds to
the session's history, which the replay completes with the model's real answers. Nothing here
sends a request.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, field

from tools.bench.config import AgenticOptions, MooncakeOptions, SyntheticOptions

TOKEN_ID_RANGE = (100, 40000)  # inside every supported model's vocabulary, clear of special tokens
TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    arrival_s: float
    new_ids: tuple[int, ...]  # appended to the session's history; the whole prompt without a session
    max_tokens: int
    session: int | None = None
    planned_prompt_tokens: int = 0
    planned_hit_tokens: int = 0  # prefix already seen (prompt or answer) when this request arrives


@dataclass(frozen=True)
class Workload:
    name: str  # e.g. "agentic-h0.90", unique within a run
    kind: str
    requests: tuple[PlannedRequest, ...]
    warmup: tuple[PlannedRequest, ...] = ()  # sent one at a time before the clock starts
    params: dict[str, object] = field(default_factory=dict)

    @property
    def planned_hit_rate(self) -> float:
        """Token-weighted, over the measured requests."""
        prompt = sum(r.planned_prompt_tokens for r in self.requests)
        return sum(r.planned_hit_tokens for r in self.requests) / prompt if prompt else 0.0


def token_ids(key: str, n: int) -> tuple[int, ...]:
    """n token ids that depend only on key (str seeds hash the same in every process)."""
    rng = random.Random(key)
    return tuple(rng.randrange(*TOKEN_ID_RANGE) for _ in range(n))


def poisson_arrivals(n: int, rate_per_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process; every request at t=0 when the rate is infinite."""
    if math.isinf(rate_per_s):
        return [0.0] * n
    return list(itertools.accumulate(rng.expovariate(rate_per_s) for _ in range(n)))


def agentic_workload(opts: AgenticOptions, n: int, rate_per_s: float, seed: int) -> Workload:
    """Long-running agent sessions and a minority of fresh requests, mixed to a mean hit rate.

    A session's turn appends the previous answer (output_tokens, kept by MD's DRC) and a tool
    output sized so the turn hits `high_hit` of its prompt; fresh requests hit nothing. With h the
    target, a fraction 1 - h/high_hit of requests is fresh (h >= high_hit: none, and every turn
    hits h). A share `tool_call_share` of the turns is answered by a short tool call
    (`tool_call_tokens`) instead, as an agent's turns mostly are. Sessions open during warm-up, as
    sessions already running when measuring starts.
    """
    h = opts.hit_rate
    if not 0 <= h < 1:
        raise ValueError(f"hit rate must be in [0, 1), got {h}")
    if not 0 <= opts.tool_call_share <= 1 or opts.tool_call_tokens < 1:
        raise ValueError("tool-call share must be in [0, 1] and a tool call at least one token")
    turn_hit = max(h, opts.high_hit)
    n_fresh = round(n * (1 - h / turn_hit))
    n_turns = n - n_fresh
    n_sessions = math.ceil(n_turns / opts.turns_per_session) if n_turns else 0
    rng = random.Random(f"agentic:{seed}:{h}")
    arrivals = poisson_arrivals(n, rate_per_s, rng)
    fresh = set(rng.sample(range(n), n_fresh))
    tool_calls = set(rng.sample(sorted(set(range(n)) - fresh), round(n_turns * opts.tool_call_share)))
    tag = f"agentic:{seed}:{h}"

    warmup = tuple(
        PlannedRequest(-1 - s, 0.0, token_ids(f"{tag}:open:{s}", opts.prefix_tokens), opts.output_tokens,
                       session=s, planned_prompt_tokens=opts.prefix_tokens)
        for s in range(n_sessions))
    history = [opts.prefix_tokens + opts.output_tokens] * n_sessions
    requests = []
    turn = 0
    for i, arrival in enumerate(arrivals):
        if i in fresh:
            ids = token_ids(f"{tag}:fresh:{i}", opts.prefix_tokens)
            requests.append(PlannedRequest(i, arrival, ids, opts.output_tokens, planned_prompt_tokens=len(ids)))
            continue
        s = turn % n_sessions
        turn += 1
        seen = history[s]
        tool = max(1, round(seen * (1 - turn_hit) / turn_hit))
        answer = opts.tool_call_tokens if i in tool_calls else opts.output_tokens
        if seen + tool + answer > opts.max_context_tokens:
            raise ValueError(f"session {s} outgrows {opts.max_context_tokens} tokens; lower --prefix-tokens, "
                             "--turns-per-session or --output-tokens")
        requests.append(PlannedRequest(i, arrival, token_ids(f"{tag}:tool:{i}", tool), answer,
                                       session=s, planned_prompt_tokens=seen + tool, planned_hit_tokens=seen))
        history[s] = seen + tool + answer
    params = {"hit_rate": h, "turn_hit_rate": turn_hit, "fresh_requests": n_fresh, "sessions": n_sessions,
              "tool_calls": len(tool_calls), "tool_call_tokens": opts.tool_call_tokens,
              "prefix_tokens": opts.prefix_tokens, "output_tokens": opts.output_tokens,
              "turns_per_session": opts.turns_per_session, "request_rate": rate_per_s, "seed": seed}
    return Workload(f"agentic-h{h:.2f}", "agentic", tuple(requests), warmup, params)


def mooncake_workload(opts: MooncakeOptions, n: int, seed: int) -> Workload:
    """The first n requests of the trace (after `skip`), by arrival time, scaled down.

    Each 512-token block becomes `block_tokens` ids that depend only on its hash id, so equal
    block ids make equal prefixes; prompt lengths scale by block_tokens/512, time by time_scale.
    Output lengths are the trace's own, capped at max_output_tokens: scaled like the prompts, a
    third of them would be one token long, and answers would no longer look like the trace's.
    """
    scale = opts.block_tokens / TRACE_BLOCK_TOKENS
    seen_blocks: set[int] = set()
    requests = []
    with opts.path.open() as f:
        rows = [json.loads(line) for line in itertools.islice(f, opts.skip, opts.skip + n)]
    t0 = rows[0]["timestamp"] if rows else 0
    for i, row in enumerate(rows):
        prompt_len = min(opts.max_input_tokens, max(2, math.ceil(row["input_length"] * scale)))
        blocks = [token_ids(f"mooncake:{seed}:{b}", opts.block_tokens) for b in row["hash_ids"]]
        ids = tuple(itertools.chain.from_iterable(blocks))[:prompt_len]
        hit_blocks = next((k for k, b in enumerate(row["hash_ids"]) if b not in seen_blocks), len(row["hash_ids"]))
        seen_blocks.update(row["hash_ids"])
        output = min(opts.max_output_tokens, max(1, int(row["output_length"])))
        requests.append(PlannedRequest(i, (row["timestamp"] - t0) / 1000 * opts.time_scale, ids, output,
                                       planned_prompt_tokens=len(ids),
                                       planned_hit_tokens=min(len(ids), hit_blocks * opts.block_tokens)))
    params = {"trace": str(opts.path), "skip": opts.skip, "block_tokens": opts.block_tokens,
              "length_scale": scale, "max_input_tokens": opts.max_input_tokens,
              "max_output_tokens": opts.max_output_tokens, "time_scale": opts.time_scale, "seed": seed}
    return Workload("mooncake", "mooncake", tuple(requests), (), params)


def synthetic_workload(opts: SyntheticOptions, n: int, rate_per_s: float, seed: int) -> Workload:
    """n unrelated prompts of input_tokens each, each answered with exactly output_tokens."""
    rng = random.Random(f"synthetic:{seed}")
    arrivals = poisson_arrivals(n, rate_per_s, rng)
    requests = tuple(
        PlannedRequest(i, t, token_ids(f"synthetic:{seed}:{i}", opts.input_tokens), opts.output_tokens,
                       planned_prompt_tokens=opts.input_tokens)
        for i, t in enumerate(arrivals))
    params = {"input_tokens": opts.input_tokens, "output_tokens": opts.output_tokens,
              "request_rate": rate_per_s, "seed": seed}
    return Workload("synthetic", "synthetic", requests, (), params)
