"""Completions `echo`: the prompt at the head of a choice, its text and, with `logprobs`, its tokens'
logprobs (P scores them), in OpenAI's completions shape; and the prompt-only request (`echo` with
`max_tokens: 0`, the loglikelihood requests of evaluation harnesses), which P serves alone.

Owns these shapes and the prompt-only answer; runs and dispatch are the run's and the dispatcher's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from services.gateway.http.admission import ClientLeft
from services.gateway.http.client_watch import ClientWatch, client_gone
from services.gateway.run.attempt import GenerationRequest
from shared.errors import ProtocolError, RequestAborted
from shared.request_ids import new_request_id

if TYPE_CHECKING:
    from services.gateway.http.detokenizer import TokenStrings
    from services.gateway.http.request_parsing import ParsedRequest
    from services.gateway.observe.request_telemetry import RequestTelemetry
    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.run.request_run import RequestRun
    from shared.sampling_params import TokenLogprob

log = logging.getLogger(__name__)

Json = dict[str, object]


class PromptEcho:
    """The prompt a completions choice starts with: its text, and its logprobs as the answer's own are
    shown (tokens, token_logprobs, top_logprobs with the chosen token always in, text_offset), where the
    first token has none (null, as OpenAI and vLLM show it). Built off the event loop: a long prompt's
    token strings take a while the first time."""

    def __init__(self, text: str, prompt_ids: tuple[int, ...], logprobs: list[TokenLogprob | None] | None,
                 strings: TokenStrings) -> None:
        self.text = text
        self.logprobs: Json | None = None
        self.text_offset_end = 0  # where the answer's own token strings start counting
        if logprobs is None:
            return
        tokens = [strings.text(token_id) for token_id in prompt_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset_end)
            self.text_offset_end += len(token)
        self.logprobs = {
            "tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else _alternatives(strings, token, lp)
                             for token, lp in zip(tokens, logprobs)],
            "text_offset": offsets}

    def choice(self) -> Json:
        """The prompt as the whole choice (max_tokens 0)."""
        return {"index": 0, "text": self.text, "logprobs": self.logprobs, "finish_reason": "length"}


def _alternatives(strings: TokenStrings, token: str, logprob: TokenLogprob) -> dict[str, float]:
    alternatives = {strings.text(top_id): value for top_id, value in logprob.top}
    alternatives.setdefault(token, logprob.logprob)
    return alternatives


async def echo_of(parsed: ParsedRequest, logprobs: list[TokenLogprob | None] | None,
                  strings: TokenStrings) -> PromptEcho:
    return await asyncio.get_running_loop().run_in_executor(
        None, PromptEcho, parsed.echo or "", parsed.prompt_ids, logprobs, strings)


@dataclass(eq=False)
class _PromptOnly:
    """A prompt-only request as RequestTelemetry reads a generation: no token."""

    run: RequestRun
    token_log: list[tuple[float, str]] = field(default_factory=list)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    close_reason: str = "error"


@dataclass(frozen=True)
class PromptOnlyServer:
    """Answers completions with `echo` and `max_tokens: 0`: the prompt, with its logprobs when asked
    (P computes them, no decoder runs; without logprobs nothing runs at all), finish_reason "length"."""

    dispatcher: Dispatcher
    telemetry: RequestTelemetry
    strings: TokenStrings
    served_model: str
    system_fingerprint: str

    async def serve(self, request: web.Request, parsed: ParsedRequest, deadline_at: float) -> web.StreamResponse:
        request_id = new_request_id()
        logprobs: list[TokenLogprob | None] | None = None
        pdd: Json = {"pipeline": "", "tokens": []}
        if parsed.prompt_logprobs is not None:
            logprobs, pdd = await self._scored(request, request_id, parsed, deadline_at)
        echo = await echo_of(parsed, logprobs, self.strings)
        head: Json = {"id": "cmpl-" + request_id[4:], "object": "text_completion", "created": int(time.time()),
                      "model": self.served_model, "system_fingerprint": self.system_fingerprint}
        prompt_tokens = len(parsed.prompt_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        choice = echo.choice()
        if not parsed.stream:
            return web.Response(body=orjson.dumps({**head, "choices": [choice], "usage": usage, "pdd": pdd}),
                                content_type="application/json", headers={"X-Request-Id": request_id})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": request_id})
        await response.prepare(request)
        events = [{**head, "choices": [choice], "pdd": pdd}]
        if parsed.include_usage:
            events.append({**head, "choices": [], "usage": usage})
        try:
            for event in events:
                await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            log.info("%s: client disconnected", request_id)
        return response

    async def _scored(self, request: web.Request, request_id: str, parsed: ParsedRequest,
                      deadline_at: float) -> tuple[list[TokenLogprob | None], Json]:
        """P alone scores the prompt: the run ends with P's report, every prompt logprob in."""
        run = await self.dispatcher.start(GenerationRequest(
            request_id=request_id, prompt_ids=list(parsed.prompt_ids), sampling=parsed.sampling, pipeline=None,
            handoff_at=None, md_kv_delay_s=0.0, failure_policy=parsed.failure_policy, deadline_at=deadline_at,
            prompt_logprobs=parsed.prompt_logprobs))
        log.info("%s: completion, %d prompt tokens, prompt logprobs only (top %d), pipeline %s", request_id,
                 len(parsed.prompt_ids), parsed.prompt_logprobs, run.pipeline)
        served = _PromptOnly(run)
        try:
            self.telemetry.started(served)
            with ClientWatch(request):
                async for token in run.tokens():
                    raise ProtocolError(f"{request_id}: token {token.index} came for a request with max_tokens 0")
            logprobs = run.prompt_logprobs
            if logprobs is None:
                raise RequestAborted(f"{request_id}: the run ended without the prompt's logprobs")
            served.finish_reason, served.close_reason = "length", "finished"
            return logprobs, {**run.summary(), "tokens": []}
        except ClientLeft:
            served.close_reason = "client_disconnected"
            raise
        except asyncio.CancelledError:
            served.close_reason = "client_disconnected" if client_gone(request) else "cancelled"
            raise
        finally:
            await run.close(served.close_reason)
            self.telemetry.finished(request, len(parsed.prompt_ids), served)
