"""Sampling parameters and a sampler whose random draw depends only on (seed, token index).

Because the draw for token i is a pure function of the request's seed and i, a seeded request
yields the same tokens whichever tier (RLD or MD) happens to produce token i. The same holds for
what depends on i alone: `min_tokens` keeps every token that would end the answer out of
positions below it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from shared.errors import BadRequest


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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequest("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise BadRequest("top_k must be 0 (off) or positive")
        if self.min_tokens < 0:
            raise BadRequest("min_tokens must be 0 or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ())),
                      "stop_token_ids": tuple(d.get("stop_token_ids", ()))})

    @property
    def ending_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the answer."""
        return self.stop_token_ids if self.ignore_eos else (*self.eos_token_ids, *self.stop_token_ids)

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in self.eos_token_ids)

    def holds_back_endings(self, token_index: int) -> bool:
        """Output position `token_index` may not end the answer (it is below min_tokens)."""
        return token_index < self.min_tokens and bool(self.ending_token_ids)


def _draw_seed(seed: int, token_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, token_index: int) -> int:
    """Pick the token at absolute output position `token_index` from last-position logits [vocab]
    (min_tokens is sample_tokens' to apply, for all rows at once)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
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


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], token_indices: Sequence[int]) -> list[int]:
    """sample_token for every row of logits [rows, vocab]; greedy rows in one argmax and one device sync."""
    logits = _without_early_endings(logits, params, token_indices)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    if greedy:
        picked = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, torch.argmax(picked, dim=-1).tolist()):
            tokens[i] = token
    for i, (p, index) in enumerate(zip(params, token_indices)):
        if not p.greedy:
            tokens[i] = sample_token(logits[i], p, index)
    return tokens


def _without_early_endings(logits: torch.Tensor, params: Sequence[SamplingParams],
                           token_indices: Sequence[int]) -> torch.Tensor:
    """The logits with every ending token at -inf in rows whose position is below min_tokens."""
    held = [(row, p.ending_token_ids) for row, (p, index) in enumerate(zip(params, token_indices))
            if p.holds_back_endings(index)]
    if not held:
        return logits
    logits = logits.clone()
    for row, ending in held:
        logits[row, list(ending)] = float("-inf")
    return logits
