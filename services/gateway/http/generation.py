"""One run's token events turned into text steps: detokenising, stop strings, the echoed prompt,
and the request's own deadline as a backstop.

Owns the text of one choice; knows nothing of response shapes, SSE or other choices.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway.http.detokenizer import OutputText, TokenStrings, as_decoder
from services.gateway.http.prompt_echo import PromptEcho, echo_of
from shared.errors import DeadlineExceeded, ProtocolError, RequestAborted
from shared.names import Role

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.gateway.http.request_parsing import ParsedRequest
    from services.gateway.run.request_run import RequestRun, TokenEvent
    from shared.config import GatewayConfig
    from shared.messages import HandoffStats
    from shared.sampling_params import TokenLogprob

Json = dict[str, object]


@dataclass(frozen=True)
class Step:
    """One token of a choice as the client is shown it: its text (empty, or several characters, or the
    text up to a stop string) and what rides with it."""

    index: int
    token_id: int
    tier: str
    text: str
    finish_reason: str | None
    handoff: Json | None  # MD's handoff stats, on the step at the run's cut (if they are known by then)
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    echo: PromptEcho | None = None  # the prompt, on the first step of a completion with echo: text is behind it

    @property
    def checked_logprob(self) -> TokenLogprob:
        assert self.logprob is not None  # Generation refuses a token without it when logprobs were asked for
        return self.logprob


def handoff_json(stats: HandoffStats) -> Json:
    return {k: v for k, v in dataclasses.asdict(stats).items() if k != "request_id"}


class Generation:
    """One run's token events turned into text steps, under the request and per-token deadlines."""

    def __init__(self, run: RequestRun, parsed: ParsedRequest, tokenizer: PreTrainedTokenizerBase,
                 config: GatewayConfig) -> None:
        self.run = run
        self._events = run.tokens()
        self._text = OutputText(as_decoder(tokenizer), parsed.prompt_ids, parsed.stop, include_stop=parsed.include_stop)
        # a client's stop_token_ids are shown, as vLLM shows them (a special token's text is empty anyway)
        self._shown_stop_ids = frozenset(parsed.sampling.stop_token_ids) - frozenset(parsed.sampling.eos_token_ids)
        self._wants_logprobs = parsed.sampling.logprobs is not None
        self._parsed = parsed
        self._prompt_strings = TokenStrings(as_decoder(tokenizer)) if parsed.echo is not None else None
        self._deadline = asyncio.get_running_loop().time() + config.request_timeout_s
        self._handoff_reported = False
        self.tokens_by_tier = {str(Role.RELAY): 0, str(Role.MAIN): 0}
        self.token_log: list[tuple[float, str]] = []  # (time.monotonic(), tier) of each token, for metrics
        self.finish_reason: str | None = None
        self.close_reason = "error"  # what run.close() is told; replaced once we know better

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    async def next_step(self) -> Step:
        event = await self._next_event()
        self.token_log.append((time.monotonic(), event.tier))
        self.tokens_by_tier[event.tier] = self.tokens_by_tier.get(event.tier, 0) + 1
        finish: str | None
        if event.finish_reason == "stop" and event.token_id not in self._shown_stop_ids:
            # EOS ends the text without showing it, as OpenAI and vLLM do.
            delta = self._text.finish()
            text, finish = delta.text, "stop"
        else:
            delta = self._text.add_token(event.token_id)
            text = delta.text
            if not delta.stopped and event.finish_reason is not None:
                delta = self._text.finish()
                text += delta.text
            finish = "stop" if delta.stopped else event.finish_reason
        if finish is not None:
            self.finish_reason = finish
            self.close_reason = "stop_string" if delta.stopped else "finished"
        handoff = self.take_handoff() if event.index == self.run.cut_index else None
        if self._wants_logprobs and event.logprob is None:
            raise ProtocolError(f"{self.run.request_id}: {event.tier} sent token {event.index} without its logprobs")
        echo = None
        if self._prompt_strings is not None and event.index == 0:  # the answer starts with the prompt
            echo = await echo_of(self._parsed, self.run.prompt_logprobs, self._prompt_strings)
            text = echo.text + text
        return Step(event.index, event.token_id, event.tier, text, finish, handoff, event.logprob, echo)

    def summary(self) -> Json:
        """The run's own summary plus what only the HTTP layer counts."""
        return {**self.run.summary(), "tokens_by_tier": dict(self.tokens_by_tier)}

    def pdd_summary(self) -> Json:
        """The summary with MD's handoff stats (None without a handoff), as a whole answer reports it."""
        handoff = self.run.handoff
        return {**self.summary(), "handoff": None if handoff is None else handoff_json(handoff)}

    def take_handoff(self) -> Json | None:
        """MD's handoff stats, the first time they are known; None before and after."""
        if self._handoff_reported or self.run.handoff is None:
            return None
        self._handoff_reported = True
        return handoff_json(self.run.handoff)

    async def _next_event(self) -> TokenEvent:
        """The next token. The run's stream enforces the next-token deadline, except while the request
        waits for P (queued is not stalled); here only the request's own deadline is a backstop."""
        request_left_s = self._deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(0.0, request_left_s)):
                return await anext(self._events)
        except StopAsyncIteration:
            raise RequestAborted("the token stream ended without a finish reason") from None
        except TimeoutError:
            raise DeadlineExceeded(f"{self.run.request_id}: the request deadline passed") from None

    async def close(self, reason: str) -> None:
        try:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self.run.close(reason)
