"""What a request asks of the sampler (`SamplingParams`, validated where it is made), one row's
sampling inputs, and what the sampler returns. Plain data: the gateway builds and sends these without
importing torch; the sampler itself is `shared/sampling.py`."""
from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from shared.errors import BadRequest

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end the answer, unless ignore_eos
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # the client's: always end it
    ignore_eos: bool = False
    min_tokens: int = 0  # no token that would end the answer at output positions below this
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time the token is in the output
    repetition_penalty: float = 1.0  # tokens in prompt or output: positive logits divided, negative multiplied
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature)
    logprobs: int | None = None  # None: off; N: each token's logprob and the N likeliest tokens'
    constraint: dict[str, str] | None = None  # shared.grammar.Constraint.to_dict(): the output's grammar

    def __post_init__(self) -> None:
        if self.max_tokens < 0:  # 0: no output token, the prompt's logprobs alone (served by P, never decoded)
            raise BadRequest("max_tokens must be 0 or more")
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequest("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise BadRequest("top_k must be 0 (off) or positive")
        if self.min_tokens < 0:
            raise BadRequest("min_tokens must be 0 or positive")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise BadRequest("presence_penalty and frequency_penalty must be between -2 and 2")
        if not (0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise BadRequest("repetition_penalty must be a positive number")
        if any(token < 0 or not -100.0 <= bias <= 100.0 for token, bias in self.logit_bias.items()):
            raise BadRequest("logit_bias maps token ids to numbers between -100 and 100")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest("min_p must be between 0 and 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be None or between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A penalty reads the request's earlier tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = {str(token): bias for token, bias in self.logit_bias.items()}  # JSON keys are strings
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ())),
                      "stop_token_ids": tuple(d.get("stop_token_ids", ())),
                      "logit_bias": {int(token): float(bias) for token, bias in d.get("logit_bias", {}).items()}})

    @property
    def ending_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the answer."""
        return self.stop_token_ids if self.ignore_eos else (*self.eos_token_ids, *self.stop_token_ids)

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in self.eos_token_ids)

    def holds_back_endings(self, token_index: int) -> bool:
        """Output position `token_index` may not end the answer (it is below min_tokens)."""
        return token_index < self.min_tokens and bool(self.ending_token_ids)

    def changes_logits(self, token_index: int) -> bool:
        """Some option changes the logits at output position `token_index` before the pick."""
        return self.penalized or bool(self.logit_bias) or self.holds_back_endings(token_index)

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids, biases) tensors, made once per request (by the sampler's tier)."""
        import torch  # here, so the gateway, which never samples, does not import it

        return (torch.tensor(list(self.logit_bias), dtype=torch.long),
                torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one row: the request's options, the output position it samples and,
    where an option reads them, the request's tokens (DecodeSequence.sampling_row fills them)."""

    params: SamplingParams
    token_index: int  # the request's output position being sampled (seeds the draw, min_tokens)
    prompt_ids: Sequence[int] = ()  # the request's own prompt: read by repetition_penalty
    output_ids: Sequence[int] = ()  # every output token before token_index: read by the penalties


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's logprob under the model's raw distribution, and the `logprobs` likeliest
    tokens as (token id, logprob), likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asks for logprobs


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request with n > 1: choice 0 keeps the request's seed, so
    n=1 and the first of n choices give the same answer; the others draw apart, reproducibly."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:choice:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
