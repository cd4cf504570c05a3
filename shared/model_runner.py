"""Tensors in, tokens out: packed forward passes over a Hugging Face causal LM.

Everything here is blocking and runs on the engine thread. A request's KV lives in one
`SequenceKV` tensor laid out like the KV wire format, [layers, 2 (K, V), kv_heads, tokens,
head_dim]. One forward packs the new tokens of many requests into a single row; transformers'
own model code runs unchanged, and only attention, plugged in through `AttentionInterface`,
knows where each request's KV lives.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import (
    sdpa_attention_forward,
    use_gqa_in_sdpa,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from shared import cpu_attention
from shared.cpu_attention import DecodeAttention, KernelUnavailable
from shared.cpu_linears import adapt_linears
from shared.sampling_params import SamplingParams, SamplingRow, TokenLogprob

if TYPE_CHECKING:
    from shared.grammar_masks import GrammarState

ATTENTION = "pdd_packed"
# Rows of up to this many tokens (decode steps, MD's extend of RLD's eager tokens, Catch-Up chunks)
# go through the CPU kernel, token by token; longer ones (prefill chunks) through SDPA, whose blocked
# kernel reads each K and V once for many query tokens.
KERNEL_ROW_TOKENS = 64
log = logging.getLogger(__name__)


class SequenceKV:
    """One request's KV: `data` [layers, 2, kv_heads, capacity, head_dim], positions [0, length) filled.

    `dtype` is the model's: what the KV leaves in (`slice`), whatever `data` keeps it in."""

    def __init__(self, data: torch.Tensor, length: int = 0, dtype: torch.dtype | None = None) -> None:
        self.data = data
        self.length = length
        self.dtype = dtype or data.dtype

    @property
    def data(self) -> torch.Tensor:
        return self._data

    @data.setter
    def data(self, data: torch.Tensor) -> None:
        self._data = data
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # views must not outlive the data

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K and V as [1, kv_heads, capacity, head_dim] views, made once per request."""
        if self._layers is None:
            self._layers = [(kv[0].unsqueeze(0), kv[1].unsqueeze(0)) for kv in self._data.unbind(0)]
        return self._layers[index]

    def slice(self, start: int, end: int) -> torch.Tensor:
        """A copy of positions [start, end) as [layers, 2, kv_heads, tokens, head_dim], in the model's dtype."""
        part = self.data[:, :, :, start:end]
        return part.clone() if part.dtype == self.dtype else part.to(self.dtype)


@dataclass
class DecodeSequence:
    """One request's state on a decoder: its KV and the output tokens it knows so far."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_context_tokens: int
    kv: SequenceKV | None = None  # set by the engine when the request is admitted
    output_ids: list[int] = field(default_factory=list)
    first_index: int = 0  # the request's output index of output_ids[0] (not 0 after a migration)
    last_logprob: TokenLogprob | None = None  # the newest sampled token's, when the request asks for logprobs
    grammar: GrammarState | None = None  # set by the engine at admission when the request has a constraint

    @property
    def request_prompt_ids(self) -> list[int]:
        """The request's own prompt: a migrated attempt's prompt ends with the first_index output tokens
        the client already has, which are not prompt."""
        return self.prompt_ids[:len(self.prompt_ids) - self.first_index]

    @property
    def request_output_ids(self) -> list[int]:
        """Every output token of the request so far, wherever it was made: by an earlier attempt (the
        end of a migrated prompt), by RLD (adopted on MD) or here."""
        return self.prompt_ids[len(self.prompt_ids) - self.first_index:] + self.output_ids

    def synced_grammar(self) -> GrammarState | None:
        """The request's grammar state, past every output token known so far: a tier that takes over
        (MD adopting RLD's eager tokens, a migrated attempt) replays what others made, and every tier
        the tokens it sampled itself. GrammarDiverged if a token breaks the grammar."""
        grammar = self.grammar
        if grammar is not None and grammar.tokens_accepted < self.first_index + len(self.output_ids):
            grammar.replay(self.request_output_ids[grammar.tokens_accepted:])
        return grammar

    def sampling_row(self) -> SamplingRow:
        """What the sampler needs for this request's next token; the history only when an option reads it."""
        params = self.sampling
        index = self.first_index + len(self.output_ids)
        if not params.penalized:
            return SamplingRow(params, index)
        prompt_ids = self.request_prompt_ids if params.repetition_penalty != 1.0 else ()
        return SamplingRow(params, index, prompt_ids, self.request_output_ids)

    @property
    def kv_tokens_needed(self) -> int:
        """The most KV positions this request can ever hold: every fed token, the last output never."""
        longest = min(len(self.prompt_ids) + self.sampling.max_tokens, self.max_context_tokens)
        return max(len(self.prompt_ids), longest - 1)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> str | None:
        self.output_ids.append(token)
        self.last_logprob = logprob
        return self.finish_reason()

    def finish_reason(self) -> str | None:
        if self.output_ids and self.sampling.is_stop(self.output_ids[-1]):
            return "stop"
        if len(self.output_ids) >= self.sampling.max_tokens:
            return "length"
        if len(self.prompt_ids) + len(self.output_ids) >= self.max_context_tokens:
            return "length"
        return None


@dataclass
class PackedRow:
    """One request's part of a packed forward: tokens appended at positions kv.length onwards."""

    kv: SequenceKV
    token_ids: list[int]
    want_logits: bool  # the logits after its last token (to sample from)
    every_logit: bool = False  # the logits after each of its tokens (a prompt's logprobs)


@dataclass
class _Pack:
    """Per-forward layout handed to the attention function through the model's kwargs."""

    rows: list[PackedRow]
    offsets: list[int]  # where each row's tokens start in the packed sequence
    masks: list[torch.Tensor | None]  # [1, 1, t, past + t] causal mask for rows of several tokens
    decode_attention: DecodeAttention | None = None  # the CPU kernel, when in use (rows up to KERNEL_ROW_TOKENS)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     pdd_pack: _Pack | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d] and new key/value [1, kv_heads, T, d] for T packed tokens.

    Each row's new K/V go into its own SequenceKV, and each row attends over its own KV only: through
    pdd's CPU kernel when in use (rows of up to KERNEL_ROW_TOKENS, a token at a time), else with the
    very call (shapes, mask, kernel) transformers' sdpa path makes for one request alone, so batching
    changes only the matmuls outside attention.
    """
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    direct = not gqa or use_gqa_in_sdpa(None, key, value)
    if pdd_pack is None:  # an ordinary forward (a DynamicCache, generate): sdpa, in the packed path's precision
        if dropout:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        one_token = query.shape[2] == 1 and attention_mask is None and direct
        return _attend(module, query, key, value, attention_mask, scaling, gqa, one_token), None
    layer = cast(int, module.layer_idx)  # torch types a Module's attributes as Tensor | Module
    kernel = pdd_pack.decode_attention
    outputs: list[torch.Tensor | int] = []  # a row's output, or how many of the kernel's outputs it takes
    starts: list[int] = []  # query tokens the kernel serves, all in one call: each over its causal prefix
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for row, start, mask in zip(pdd_pack.rows, pdd_pack.offsets, pdd_pack.masks):
        past, n = row.kv.length, len(row.token_ids)
        cache_k, cache_v = row.kv.layer(layer)
        cache_k.narrow(2, past, n).copy_(key.narrow(2, start, n))
        cache_v.narrow(2, past, n).copy_(value.narrow(2, start, n))
        if kernel is not None and n <= KERNEL_ROW_TOKENS:
            for i in range(n):  # token i of the row attends to positions [0, past + i]: the causal mask
                starts.append(start + i)
                keys.append(cache_k.narrow(2, 0, past + i + 1))
                values.append(cache_v.narrow(2, 0, past + i + 1))
            outputs.append(n)
        else:
            k, v = cache_k.narrow(2, 0, past + n), cache_v.narrow(2, 0, past + n)
            outputs.append(_attend(module, query.narrow(2, start, n), k, v, mask, scaling, gqa, n == 1 and direct))
    parts: list[torch.Tensor] = []
    if kernel is not None and starts:
        served = _decode_attention(kernel, query, starts, keys, values, scaling)
        if len(starts) == query.shape[2]:
            return served.unsqueeze(0), None
        taken = 0
        for out in outputs:
            if isinstance(out, int):
                parts.append(served[taken:taken + out].unsqueeze(0))
                taken += out
            else:
                parts.append(out)
    else:  # no kernel in this forward: every row's output is a tensor already
        parts = [out for out in outputs if isinstance(out, torch.Tensor)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), None


def _decode_attention(kernel: DecodeAttention, query: torch.Tensor, starts: list[int], keys: list[torch.Tensor],
                      values: list[torch.Tensor], scaling: float | None) -> torch.Tensor:
    """The kernel over the query tokens at `starts` of query [1, heads, T, d]: [tokens, heads, d], query's dtype."""
    rows = query[0].transpose(0, 1)  # [T, heads, d]
    if len(starts) < rows.shape[0]:
        rows = rows[starts]
    q = rows.to(torch.float32, memory_format=torch.contiguous_format)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kernel(q, keys, values, scale).to(query.dtype)


def _attend(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scaling: float | None, gqa: bool, one_token: bool) -> torch.Tensor:
    """Attention of q [1, heads, t, d] over k, v; the output as [1, t, heads, d].

    On a CPU, half-precision models attend in float32 and round the output once: torch's
    bfloat16 kernel for one query token is about 6x slower than its float32 one there (584
    against 98 us per call at 512 positions, conversion included), and one precision for every
    attention keeps a decoder's token-by-token KV equal to MD's one-pass recomputation of it.
    """
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    if one_token:
        # the very call sdpa_attention_forward makes for one query token and no mask, minus its
        # per-call checks, which cost more than the attention itself at decode sizes on a CPU
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa).transpose(1, 2)
    else:
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling)
    return out.to(dtype)


AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # ordinary forwards get sdpa's masks


DECODE_ATTENTION_CHOICES = ("auto", "kernel", "sdpa")


def pick_decode_attention(choice: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                          head_dim: int) -> DecodeAttention | None:
    """The attention for rows of up to KERNEL_ROW_TOKENS: pdd's CPU kernel (shared/cpu_attention), or None
    for torch's SDPA.

    'auto' takes the kernel for a half-precision model on a CPU when it builds here (float32 models
    keep SDPA, whose results equal transformers'); 'kernel' takes it for any model on a CPU and
    fails when it cannot; 'sdpa' never takes it.
    """
    if choice not in DECODE_ATTENTION_CHOICES:
        raise ValueError(f"decode attention {choice!r}: one of {', '.join(DECODE_ATTENTION_CHOICES)}")
    usable = device.type == "cpu" and cpu_attention.supports(heads, kv_heads, head_dim)
    if choice == "sdpa" or (choice == "auto" and not (usable and dtype in (torch.bfloat16, torch.float16))):
        return None
    if not usable:
        raise KernelUnavailable(f"the CPU decode attention kernel serves CPU models with head_dim in "
                                f"{cpu_attention.HEAD_DIMS} and at most {cpu_attention.MAX_GROUP} query heads "
                                f"per KV head; this one is on {device} with {heads} heads, {kv_heads} KV "
                                f"heads of {head_dim}")
    try:
        return cpu_attention.load()
    except KernelUnavailable as exc:
        if choice == "kernel":
            raise
        log.warning("%s; one-token attention uses torch's SDPA", exc)
        return None


def _causal_mask(past: int, n: int, device: torch.device) -> torch.Tensor | None:
    """As transformers masks one request: none for one token or a fresh prompt (sdpa's is_causal)."""
    if n == 1 or past == 0:
        return None
    allowed = torch.arange(past + n, device=device)[None, :] <= torch.arange(past, past + n, device=device)[:, None]
    return allowed.view(1, 1, n, past + n)


class ModelRunner:
    def __init__(self, model: PreTrainedModel, decode_attention: str = "auto", row_invariant: bool = True) -> None:
        """`row_invariant`: a row's outputs never depend on how many rows share its step (decoders;
        P's runner passes False, so its long prefill chunks are not split: shared/cpu_linears.py)."""
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_context_tokens = int(getattr(model.config, "max_position_embeddings", 2048))
        self.num_layers = model.config.num_hidden_layers
        self.kv_heads = model.config.num_key_value_heads or model.config.num_attention_heads
        heads = model.config.num_attention_heads
        self.head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // heads
        self.decode_attention = pick_decode_attention(decode_attention, self.device, self.dtype, heads,
                                                      self.kv_heads, self.head_dim)
        # A half-precision model on a CPU attends in float32 (_attend, the kernel). The kernel reads
        # bfloat16 KV directly, so there the KV stays bfloat16; otherwise it is kept in float32, so no
        # step converts a request's whole KV again. Every value is the model's own rounding (K and V
        # come out of its projections in its dtype, received KV is rounded to it first), so the choice
        # changes no result, only memory and speed.
        half = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
        bfloat16_kv = self.decode_attention is not None and self.dtype == torch.bfloat16
        self.kv_dtype = torch.float32 if half and not bfloat16_kv else self.dtype
        model.set_attn_implementation(ATTENTION)
        # bfloat16 on a CPU: weights packed where that changes no bit; a decoder's rows alike at any count
        self.packed_linears = adapt_linears(model, row_invariant=row_invariant)
        log.info("%s on %s: one-token attention by %s, KV kept in %s, %d linears packed", self.dtype, self.device,
                 "pdd's CPU kernel" if self.decode_attention else "torch's SDPA", self.kv_dtype, self.packed_linears)

    def stats(self) -> dict[str, int | float]:
        """What the runner adds to the engine's heartbeat stats (the simulated one: its modelled time)."""
        return {}

    def new_kv(self, capacity: int, parts: Sequence[torch.Tensor] = ()) -> SequenceKV:
        """Room for `capacity` positions, starting with parts [layers, 2, kv_heads, tokens, head_dim] in order."""
        data = torch.empty((self.num_layers, 2, self.kv_heads, capacity, self.head_dim), dtype=self.kv_dtype,
                           device=self.device)
        kv = SequenceKV(data, dtype=self.dtype)
        for part in parts:
            self.append_kv(kv, part)
        return kv

    def append_kv(self, kv: SequenceKV, part: torch.Tensor) -> None:
        """Copy part [layers, 2, kv_heads, tokens, head_dim] into the positions after kv's filled ones."""
        n = part.shape[3]
        if kv.length + n > kv.capacity:
            raise ValueError(f"{kv.length + n} KV positions do not fit a capacity of {kv.capacity}")
        kv.data[:, :, :, kv.length:kv.length + n] = part.to(self.dtype)  # the model's rounding, then kept
        kv.length += n

    def grown(self, data: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        """A request's KV data with room for `capacity` positions, its first `length` copied over."""
        shape = (*data.shape[:3], capacity, data.shape[4])
        bigger = torch.empty(shape, dtype=data.dtype, device=data.device)
        bigger[:, :, :, :length] = data[:, :, :, :length]
        return bigger

    @torch.inference_mode()
    def forward_packed(self, rows: list[PackedRow]) -> torch.Tensor:
        """Append each row's tokens to its KV in one forward; logits [kept positions, vocab] in row order:
        one per row that wants them, one per token of an every_logit row."""
        ids: list[int] = []
        positions: list[int] = []
        offsets: list[int] = []
        masks: list[torch.Tensor | None] = []
        keep: list[int] = []
        for row in rows:
            n = len(row.token_ids)
            if row.kv.length + n > row.kv.capacity:
                raise ValueError(f"KV holds {row.kv.length} of {row.kv.capacity} positions; {n} more do not fit")
            offsets.append(len(ids))
            ids += row.token_ids
            positions += range(row.kv.length, row.kv.length + n)
            masks.append(_causal_mask(row.kv.length, n, self.device))
            if row.every_logit:
                keep += range(len(ids) - n, len(ids))
            elif row.want_logits:
                keep.append(len(ids) - 1)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        no_mask = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=self.device)  # 4D: transformers skips masking
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, use_cache=False,
                         logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                         pdd_pack=_Pack(rows, offsets, masks, self.decode_attention))
        for row in rows:
            row.kv.length += len(row.token_ids)
        return out.logits[0]

    def forward(self, kv: SequenceKV, token_ids: list[int]) -> torch.Tensor:
        """One request alone: append token_ids; the logits after the last one, shape [vocab]."""
        return self.forward_packed([PackedRow(kv, token_ids, True)])[0]
