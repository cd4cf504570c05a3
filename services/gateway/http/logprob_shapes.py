"""A response's logprobs in OpenAI's shapes, from each step's TokenLogprob (the model's raw
distribution): chat's `content` entries, or completions' parallel lists.

Owns the logprobs object only; the choice it sits in is response_shapes.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gateway.http.detokenizer import TokenStrings
    from services.gateway.http.generation import Step
    from shared.sampling_params import TokenLogprob

Json = dict[str, object]


class Logprobs:
    """One choice's logprobs. Chat: `content`, an entry per token with its `top_logprobs`. Completions:
    parallel lists, where `top_logprobs` holds the likeliest tokens and always the chosen one, and
    `text_offset` counts the tokens' own strings, as vLLM counts it."""

    def __init__(self, strings: TokenStrings, chat: bool) -> None:
        self._strings = strings
        self._chat = chat
        self._text_offset = 0  # completions: where the next token's string starts

    def of(self, steps: list[Step]) -> Json:
        if self._chat:
            return {"content": [self._chat_entry(step.token_id, step.checked_logprob) for step in steps]}
        first_echo = steps[0].echo if steps else None
        echo = first_echo.logprobs if first_echo is not None else None
        if first_echo is not None and echo is not None:  # the prompt's entries first; the answer's count on after
            self._text_offset = first_echo.text_offset_end
        tokens, offsets = [self._strings.text(step.token_id) for step in steps], []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        shaped: Json = {"tokens": tokens, "token_logprobs": [step.checked_logprob.logprob for step in steps],
                        "top_logprobs": [self._alternatives(step) for step in steps], "text_offset": offsets}
        return shaped if echo is None else {key: [*echo[key], *shaped[key]] for key in shaped}  # type: ignore[misc]

    def _chat_entry(self, token_id: int, logprob: TokenLogprob) -> Json:
        return {**self._token(token_id, logprob.logprob),
                "top_logprobs": [self._token(top_id, value) for top_id, value in logprob.top]}

    def _token(self, token_id: int, logprob: float) -> Json:
        text, raw = self._strings.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _alternatives(self, step: Step) -> dict[str, float]:
        logprob = step.checked_logprob
        alternatives = {self._strings.text(top_id): value for top_id, value in logprob.top}
        alternatives.setdefault(self._strings.text(step.token_id), logprob.logprob)
        return alternatives
