"""Sampling parameters and a sampler whose choice for a row depends only on that row's request.

The random draw for output token i is a pure function of the request's seed and i, and what the
options read besides the logits (the position, the request's prompt and every earlier output token)
every tier knows, so a request yields the same tokens whichever tier (RLD or MD) produces token i,
and after a migration. Options follow vLLM's definitions, in vLLM's order:

0. (the engine, before this module) a grammar's mask, for requests with a `constraint`;
1. logprobs: log_softmax of the model's logits, before anything below (vLLM's "raw_logprobs");
2. min_tokens, logit_bias;
3. repetition, frequency and presence penalties;
4. greedy: argmax; random: temperature, min_p, top_k, top_p, then the seeded draw.
"""
from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from shared.errors import BadRequest

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM show -9999.0 for it


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
        """logit_bias as (token ids, biases) tensors, made once per request."""
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


def _draw_seed(seed: int, token_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, token_index: int) -> int:
    """Pick the token at absolute output position `token_index` from last-position logits [vocab]
    whose options (min_tokens, logit_bias, penalties) are already applied."""
    if params.greedy:
        return int(_argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    generator = torch.Generator(device="cpu").manual_seed(_draw_seed(params.seed, token_index))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sampled]:
    """One token for each row of logits [rows, vocab]. Rows without options cost what greedy always
    did (one batched argmax); options and logprobs are batched over the rows that ask for them."""
    adjusted = apply_options(logits, rows)
    tokens = _pick(adjusted, rows)
    logprobs = _logprobs(logits, rows, tokens)
    return [Sampled(token, logprob) for token, logprob in zip(tokens, logprobs)]


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], token_indices: Sequence[int]) -> list[int]:
    """sample_rows for rows that read no earlier tokens: just the token ids."""
    rows = [SamplingRow(p, index) for p, index in zip(params, token_indices)]
    return [s.token_id for s in sample_rows(logits, rows)]


def apply_options(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits with every row's min_tokens, logit_bias and penalties applied (a float32
    copy), or the logits themselves when no row has any."""
    changed = [i for i, row in enumerate(rows) if row.params.changes_logits(row.token_index)]
    if not changed:
        return logits
    logits = logits.to(torch.float32, copy=True)
    for i in changed:
        row, params = rows[i], rows[i].params
        if params.holds_back_endings(row.token_index):
            logits[i, list(params.ending_token_ids)] = float("-inf")
        if params.logit_bias:
            ids, biases = params.logit_bias_tensors
            logits[i].index_add_(0, ids.to(logits.device), biases.to(logits.device))
    penalized = [i for i in changed if rows[i].params.penalized]
    if penalized:
        _penalize(logits, penalized, [rows[i] for i in penalized])
    return logits


def _penalize(logits: torch.Tensor, row_ids: Sequence[int], rows: Sequence[SamplingRow]) -> None:
    """vLLM's penalties, in place on logits [rows, vocab], touching only the tokens each row has seen:
    repetition over prompt and output tokens (a positive logit divided, a negative one multiplied),
    then frequency (per occurrence) and presence (once) over output tokens, as OpenAI defines them."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    device = logits.device

    def keys(row_id: int, token_ids: Sequence[int]) -> torch.Tensor:  # each token's place in flat
        ids = torch.tensor(token_ids, dtype=torch.long)
        return ids[ids < vocab] + row_id * vocab  # an id past the logits (a padded vocabulary) has no logit

    output_keys = torch.cat([keys(i, row.output_ids) for i, row in zip(row_ids, rows)]).to(device)
    by_row = torch.zeros(len(logits), 3, dtype=torch.float32)  # repetition, frequency, presence per logits row
    by_row[list(row_ids)] = torch.tensor([[row.params.repetition_penalty, row.params.frequency_penalty,
                                           row.params.presence_penalty] for row in rows])
    repetition, frequency, presence = by_row.to(device).unbind(1)
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        prompt_keys = torch.cat([keys(i, row.prompt_ids) for i, row in zip(row_ids, rows)]).to(device)
        seen = torch.unique(torch.cat([prompt_keys, output_keys]))
        values, penalty = flat[seen], repetition[seen // vocab]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    seen, counts = torch.unique(output_keys, return_counts=True)
    owner = seen // vocab
    flat[seen] = flat[seen] - frequency[owner] * counts - presence[owner]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest logit of each row (the first of equals). torch's CPU argmax is 3x
    slower on bfloat16 than converting to float32 first (2.9 against 0.9 ms for 16 x 49152), and
    the conversion is exact, so the index is the same."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return torch.argmax(logits, dim=-1)


def _pick(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Greedy rows in one argmax and one device sync; random rows each with their own seeded draw."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    tokens = [0] * len(rows)
    if greedy:
        picked = logits if len(greedy) == len(rows) else logits[greedy]
        for i, token in zip(greedy, _argmax(picked).tolist()):
            tokens[i] = token
    for i, row in enumerate(rows):
        if not row.params.greedy:
            tokens[i] = sample_token(logits[i], row.params, row.token_index)
    return tokens


def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: Sequence[int]) -> list[TokenLogprob | None]:
    """The chosen tokens' and the likeliest tokens' logprobs under the raw logits, for the rows that ask."""
    wanting = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    found: list[TokenLogprob | None] = [None] * len(rows)
    if not wanting:
        return found
    raw = (logits if len(wanting) == len(rows) else logits[wanting]).float()
    # log_softmax read only where needed: a logit less the row's logsumexp
    normalizer = torch.logsumexp(raw, dim=-1, keepdim=True)
    chosen_ids = torch.tensor([[tokens[i]] for i in wanting], device=raw.device)
    chosen = (raw.gather(1, chosen_ids) - normalizer).clamp_min(MIN_LOGPROB).squeeze(1).tolist()
    most = max(rows[i].params.logprobs or 0 for i in wanting)
    top_values, top_ids = raw.topk(most, dim=-1) if most else (raw[:, :0], raw[:, :0].long())
    top_logprobs, top_token_ids = (top_values - normalizer).clamp_min(MIN_LOGPROB).tolist(), top_ids.tolist()
    for k, i in enumerate(wanting):
        n = rows[i].params.logprobs
        found[i] = TokenLogprob(chosen[k], tuple(zip(top_token_ids[k][:n], top_logprobs[k][:n])))
    return found


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], top_n: int,
                 rows_per_slice: int = 128) -> list[TokenLogprob]:
    """Row i's logprob of token_ids[i] under the raw logits [rows, vocab], and its top_n likeliest
    (a prompt's logprobs: row i is the position before token_ids[i]). A slice of rows at a time, so a
    long chunk never holds a second [rows, vocab] copy in float32."""
    scored: list[TokenLogprob] = []
    for first in range(0, len(token_ids), rows_per_slice):
        raw = logits[first:first + rows_per_slice].float()
        normalizer = torch.logsumexp(raw, dim=-1, keepdim=True)
        ids = torch.tensor(list(token_ids[first:first + rows_per_slice]), device=raw.device).unsqueeze(1)
        chosen = (raw.gather(1, ids) - normalizer).clamp_min(MIN_LOGPROB).squeeze(1).tolist()
        top_values, top_ids = raw.topk(top_n, dim=-1) if top_n else (raw[:, :0], raw[:, :0].long())
        top_logprobs, top_token_ids = (top_values - normalizer).clamp_min(MIN_LOGPROB).tolist(), top_ids.tolist()
        scored += [TokenLogprob(value, tuple(zip(top_token_ids[k], top_logprobs[k])))
                   for k, value in enumerate(chosen)]
    return scored
