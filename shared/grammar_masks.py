"""Constrained decoding, the decoder's half: the vocabulary as llguidance sees it, one `GrammarState`
per constrained sequence, and a batch's logits masked by their grammars.

A decoder that takes over mid-answer (handoff, Catch-Up, migration) `replay`s the tokens made before
it, so its state equals the first tier's. This module never samples and never ends a sequence itself.

    grammars = GrammarCompiler.from_hf(hf_tokenizer, logits_width, eos_token_ids)   # once per decoder
    state = grammars.new_state(Constraint.from_dict(wire)); state.replay(earlier_ids)
    grammars.apply_masks(logits, [state or None per row]); ...; state.accept(token_id)
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import llguidance
import llguidance.hf
import numpy as np
import torch

from shared.grammar import Constraint, GrammarDiverged, InvalidConstraint, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

MATCHER_CACHE_SIZE = 64


class GrammarCompiler:
    """The model's vocabulary as llguidance sees it, built once per decoder (about 0.5 s), plus the
    thread pool and bitmask buffer for masking a batch. Engine thread only."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, logits_width: int) -> None:
        if tokenizer.vocab_size < logits_width:
            raise ValueError(f"the grammar tokenizer has {tokenizer.vocab_size} tokens, the logits {logits_width}")
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self._executor: llguidance.LLExecutor | None = None  # threads for masking many rows, made on first use
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)  # [rows, ceil(vocab / 32)], grown on demand
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> pristine matcher

    @classmethod
    def from_hf(cls, hf_tokenizer: PreTrainedTokenizerBase, logits_width: int,
                eos_token_ids: Sequence[int] = ()) -> GrammarCompiler:
        """`logits_width`: the model's vocab_size, which may exceed len(tokenizer); the columns past
        the tokenizer are padding and never allowed. `eos_token_ids`: the tokens that may end a
        finished grammar (default: the tokenizer's EOS)."""
        n_vocab = max(logits_width, len(hf_tokenizer))
        eos = list(eos_token_ids) or None
        # AutoTokenizer gives a fast tokenizer (the kind llguidance reads); transformers types it as the base
        fast = cast("PreTrainedTokenizerFast", hf_tokenizer)
        return cls(llguidance.hf.from_tokenizer(fast, n_vocab=n_vocab, eos_token=eos), logits_width)

    def new_state(self, constraint: Constraint) -> GrammarState:
        pristine = self._matchers.get(constraint.grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
            if pristine.is_error():
                raise InvalidConstraint(None, f"the grammar cannot be enforced: {first_line(pristine.get_error())}")
            self._matchers[constraint.grammar] = pristine
            if len(self._matchers) > MATCHER_CACHE_SIZE:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(constraint.grammar)
        return GrammarState(pristine.deep_copy(), self)

    def apply_masks(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """Set every token row i's grammar forbids to -inf in logits [rows, logits_width], in place.
        Rows whose state is None are untouched; when all are None nothing is computed or allocated."""
        rows = [i for i, state in enumerate(states) if state is not None]
        if not rows:
            return
        words = (self.tokenizer.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(len(rows), 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]
        matchers = [(states[row]._matcher, k) for k, row in enumerate(rows)]  # type: ignore[union-attr]
        if len(matchers) == 1:
            matchers[0][0].unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        allowed = _unpack(bitmask, logits.shape[1], logits.device)
        minus_inf = _minus_inf(logits)
        if len(rows) == logits.shape[0]:
            torch.where(allowed, logits, minus_inf, out=logits)  # faster than masked_fill_ on CPU
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = torch.where(allowed, logits[index], minus_inf)


def _unpack(bitmask: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """bitmask [rows, words] int32, bit j of word w allowing token 32w + j -> allowed [rows, width] bool."""
    if device.type == "cpu":  # numpy unpacks bits in a few microseconds; int32 words are little-endian
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :width]
        return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)
    return _unpack_with_shifts(bitmask.to(device), width)


def _unpack_with_shifts(words: torch.Tensor, width: int) -> torch.Tensor:
    """_unpack on the logits' own device (a GPU): 4 bytes a word cross the bus, not 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :width].bool()


def _minus_inf(logits: torch.Tensor) -> torch.Tensor:
    key = (logits.device, logits.dtype)
    if key not in _MINUS_INF:
        _MINUS_INF[key] = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return _MINUS_INF[key]


_MINUS_INF: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


class GrammarState:
    """One sequence's place in its grammar. Made by GrammarCompiler.new_state."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: GrammarCompiler) -> None:
        self._matcher = matcher
        self._grammars = grammars
        self.tokens_accepted = 0

    def replay(self, token_ids: Sequence[int]) -> None:
        """Feed output tokens another tier made (in order; successive chunks may follow)."""
        token_ids = [int(t) for t in token_ids]
        taken = self._matcher.try_consume_tokens(token_ids)
        self.tokens_accepted += taken
        if taken < len(token_ids):
            self.accept(token_ids[taken])  # raises, with the matcher's reason

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token (an EOS ending a finished grammar is accepted too). After
        GrammarDiverged the state is spent: the sequence must end."""
        if not self._matcher.consume_token(int(token_id)):
            raise GrammarDiverged(f"output token {self.tokens_accepted} (id {token_id}) breaks the grammar: "
                                  f"{first_line(self._matcher.get_error())}")
        self.tokens_accepted += 1

    @property
    def finished(self) -> bool:
        """The grammar is complete: only EOS is allowed next."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher gave up (a resource limit mid-answer); it then allows only EOS."""
        return first_line(self._matcher.get_error()) if self._matcher.is_error() else None
