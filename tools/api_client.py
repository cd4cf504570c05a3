"""A small client for pdd's OpenAI API that keeps what the `pdd` extension reports per token.

Used by tests and benchmarks: it records each token's id, tier and arrival time, so callers can
check token-exactness across tiers and measure TTFT and the gaps between tokens. Against a server
without the extension (a peer such as vLLM) it times each chunk that carries text instead, as
`vllm bench serve` does, with the tier PEER_TIER and no token ids.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

Json = dict[str, object]
PEER_TIER = "peer"


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Json) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {error.get('message') if isinstance(error, dict) else body}")
        self.status = status
        self.body = body


@dataclass
class StreamResult:
    response_id: str | None = None  # the stream's `id` (pdd: "cmpl-" + the request id's hex)
    token_ids: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # since the request was sent
    text: str = ""
    finish_reason: str | None = None
    usage: Json | None = None
    summary: Json = field(default_factory=dict)  # the final chunk's pdd field
    handoff: Json | None = None
    logprobs: list[Json] = field(default_factory=list)  # each chunk's choices[0].logprobs, when it has them

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[Json]:
    """The JSON objects of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield orjson.loads(data)


async def stream_completion(session: aiohttp.ClientSession, api_url: str, body: Json,
                            path: str = "/v1/completions",
                            on_token: Callable[[int, str], None] | None = None) -> StreamResult:
    """POST a streamed request; raise ApiError for an HTTP error or an error event in the stream.

    `on_token(index, tier)` is called as each token arrives (fault tests time a kill with it)."""
    result = StreamResult()
    from_pdd = False
    t0 = time.monotonic()
    async with session.post(api_url + path, json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as resp:
        if resp.status != 200:
            raise ApiError(resp.status, await resp.json(content_type=None))
        async for event in sse_events(resp):
            if "error" in event:
                raise ApiError(200, event)
            if result.response_id is None and isinstance(event.get("id"), str):
                result.response_id = event["id"]
            if event.get("usage"):
                result.usage = event["usage"]
            pdd = event.get("pdd") or {}
            from_pdd = from_pdd or "pdd" in event
            for token in pdd.get("tokens", ()):
                result.token_ids.append(token["id"])
                result.tiers.append(token["tier"])
                result.token_times_s.append(time.monotonic() - t0)
                if on_token is not None:
                    on_token(len(result.token_ids) - 1, token["tier"])
            if pdd.get("handoff"):
                result.handoff = pdd["handoff"]
            for choice in event.get("choices", ()):
                if choice.get("logprobs"):
                    result.logprobs.append(choice["logprobs"])
                delta = choice.get("delta") or {}
                text = delta.get("content") or choice.get("text") or ""
                result.text += text
                if text and not from_pdd:  # a peer: a chunk of text is the unit that is timed
                    result.tiers.append(PEER_TIER)
                    result.token_times_s.append(time.monotonic() - t0)
                    if on_token is not None:
                        on_token(len(result.tiers) - 1, PEER_TIER)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                    result.summary = pdd
    return result
