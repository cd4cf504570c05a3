"""The demo client behind `pdd demo`: one streamed chat request, each token marked by its tier.

Reads the gateway's SSE stream (OpenAI chunks plus the "pdd" extension field), prints the answer
as it arrives with RLD and MD tokens told apart (colours on a terminal, [RLD]/[MD] brackets
elsewhere), marks the handoff, and returns the numbers for a summary. It starts no processes.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from shared.names import AUTO, Pipeline, choices
from tools.api_client import sse_events

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
DEFAULT_MD_KV_DELAY_MS = 400.0
DEFAULT_PIPELINE = str(Pipeline.P_RLD_MD)  # the demo shows a handoff unless asked otherwise
PIPELINES = choices(Pipeline.requestable(), AUTO)  # AUTO: the request names none
TIER_LABELS = {"prefill": "P", "relay": "RLD", "main": "MD"}
TIER_COLOURS = {"prefill": "\x1b[32m", "relay": "\x1b[33m", "main": "\x1b[36m"}
MARKER_COLOUR = "\x1b[1;35m"
RESET = "\x1b[0m"

Json = dict[str, Any]  # one decoded SSE event, as the gateway sent it


class DemoError(RuntimeError):
    """The gateway refused the request or the stream ended with an error."""


@dataclass(frozen=True)
class DemoOptions:
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    pipeline: str = DEFAULT_PIPELINE
    md_kv_delay_ms: float | None = None  # None: DEFAULT_MD_KV_DELAY_MS unless on p-md, 0 there
    temperature: float = 0.0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:  # never send a field the gateway would refuse
            raise ValueError(f"demo pipeline must be one of {list(PIPELINES)}, got {self.pipeline!r}")

    def request_body(self, model: str | None) -> dict[str, object]:
        delay_ms = self.md_kv_delay_ms
        if delay_ms is None:
            delay_ms = 0.0 if self.pipeline == Pipeline.P_MD else DEFAULT_MD_KV_DELAY_MS
        ext: dict[str, object] = {"md_kv_delay_ms": delay_ms}
        if self.pipeline != AUTO:
            ext["pipeline"] = self.pipeline
        body: dict[str, object] = {
            "messages": [{"role": "user", "content": self.prompt}],
            "stream": True,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "pdd": ext,
        }
        if model:
            body["model"] = model
        return body


@dataclass
class DemoResult:
    pipeline: str
    text: str = ""
    tokens_by_tier: Counter[str] = field(default_factory=Counter)
    handoff: Json | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    last_token_s: float | None = None

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first: the rate a reader sees."""
        if self.ttft_s is None or self.last_token_s is None or self.tokens < 2:
            return None
        span_s = self.last_token_s - self.ttft_s
        return (self.tokens - 1) / span_s if span_s > 0 else None

    def summary(self) -> str:
        rows = [("pipeline", self.pipeline)]
        rows.append(("TTFT", f"{self.ttft_s * 1e3:.0f} ms" if self.ttft_s is not None else "-"))
        rate = self.decode_tokens_per_s
        rows.append(("tokens/s", f"{rate:.1f} (decode, after the first token)" if rate else "-"))
        rows.append(("tokens", f"{self.tokens} in {self.total_s:.2f} s, finish: {self.finish_reason or '-'}"))
        for tier, count in self.tokens_by_tier.items():
            name = {"relay": "eager tokens by RLD", "main": "tokens by MD"}.get(tier, f"tokens by {tier}")
            rows.append((name, str(count)))
        rows.append(("handoff", _describe_handoff(self.handoff, self.tokens_by_tier)))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _describe_handoff(handoff: Json | None, tokens_by_tier: Counter[str]) -> str:
    if handoff is None:
        if tokens_by_tier.get("relay") and not tokens_by_tier.get("main"):
            return "none: RLD finished the request before MD was ready"
        return "none"
    parts = [f"after {handoff.get('eager_tokens', '?')} eager tokens"]
    for key, value in handoff.items():
        if key.endswith("_s") and isinstance(value, int | float):
            parts.append(f"{key[:-2].replace('_', ' ')} {value * 1e3:.0f} ms")
    return ", ".join(parts)


class TierPainter:
    """Writes streamed text marked by tier: ANSI colours on a terminal, [TIER] brackets otherwise."""

    def __init__(self, out: TextIO, colour: bool) -> None:
        self.out = out
        self.colour = colour
        self._tier: str | None = None
        self._handoff_shown = False

    @classmethod
    def for_stream(cls, out: TextIO) -> TierPainter:
        return cls(out, colour=out.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb")

    def legend(self) -> str:
        if self.colour:
            return (f"legend: {TIER_COLOURS['relay']}RLD eager tokens{RESET} (Relay Decode, near the user), "
                    f"{TIER_COLOURS['main']}MD tokens{RESET} (Main Decode), "
                    f"{MARKER_COLOUR}|handoff|{RESET} where MD takes over")
        return ("legend: [RLD] eager tokens from Relay Decode (near the user), [MD] tokens from Main Decode, "
                "|handoff ...| where MD takes over")

    def write(self, text: str, tier: str) -> None:
        if tier == "main" and self._tier == "relay" and not self._handoff_shown:
            self._marker("|handoff to MD|")  # the stats come in a later chunk, if at all
        if self.colour:
            self.out.write(f"{TIER_COLOURS.get(tier, '')}{text}{RESET}")
        else:
            if tier != self._tier:
                self.out.write(f"[{TIER_LABELS.get(tier, tier.upper())}]")
            self.out.write(text)
        self._tier = tier
        self.out.flush()

    def handoff(self, handoff: Json) -> None:
        """Mark where MD takes over, unless MD's tokens are already on screen (stats came late)."""
        if self._handoff_shown or self._tier == "main":
            return
        marker = f"|handoff after {handoff.get('eager_tokens', '?')} eager tokens"
        if isinstance(handoff.get("handoff_s"), int | float):
            marker += f", {handoff['handoff_s'] * 1e3:.0f} ms"
        self._marker(marker + "|")

    def _marker(self, marker: str) -> None:
        self._handoff_shown = True
        self.out.write(f" {MARKER_COLOUR}{marker}{RESET} " if self.colour else f" {marker} ")
        self.out.flush()

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def _chunk_tier(tokens: list[Json], previous: str | None) -> str:
    """A chunk's text cannot be split per token, so it takes the tier most of its tokens came from."""
    if not tokens:
        return previous or "relay"
    return Counter(str(t.get("tier")) for t in tokens).most_common(1)[0][0]


async def run_demo(api_url: str, options: DemoOptions, out: TextIO, *, model: str | None = None,
                   painter: TierPainter | None = None) -> DemoResult:
    """Send one streamed chat request and print it as it arrives; returns what the summary shows."""
    painter = painter or TierPainter.for_stream(out)
    result = DemoResult(pipeline=options.pipeline)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    began = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{api_url}/v1/chat/completions", json=options.request_body(model)) as resp:
            if resp.status != 200:
                raise DemoError(f"gateway answered HTTP {resp.status}: {(await resp.text()).strip()[:500]}")
            tier: str | None = None
            async for event in sse_events(resp):
                if "error" in event:
                    painter.end()
                    raise DemoError(f"stream failed: {event['error']}")
                tier = _apply_chunk(event, result, painter, tier, time.monotonic() - began)
    result.total_s = time.monotonic() - began
    painter.end()
    return result


def _apply_chunk(event: Json, result: DemoResult, painter: TierPainter,
                 tier: str | None, elapsed_s: float) -> str | None:
    ext: Json = event.get("pdd") or {}
    tokens: list[Json] = ext.get("tokens") or []
    result.pipeline = str(ext.get("pipeline") or result.pipeline)
    if ext.get("handoff") is not None:
        result.handoff = dict(ext["handoff"])
        painter.handoff(result.handoff)
    choice: Json = (event.get("choices") or [{}])[0]
    text: str = (choice.get("delta") or {}).get("content") or ""
    result.finish_reason = choice.get("finish_reason") or result.finish_reason
    if tokens or text:
        tier = _chunk_tier(tokens, tier)
        result.tokens_by_tier.update(str(t.get("tier")) for t in tokens)
        if result.ttft_s is None:
            result.ttft_s = elapsed_s
        result.last_token_s = elapsed_s
    if text:
        result.text += text
        painter.write(text, tier or "relay")
    return tier
