"""The sampler, whose choice for a row depends only on that row's request (its parameters are
`shared/sampling_params.py`).

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

import hashlib
from collections.abc import Sequence

import torch

from shared.sampling_params import Sampled, SamplingParams, SamplingRow, TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM show -9999.0 for it


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
