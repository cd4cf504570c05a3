"""Token ids to user-visible text, one token at a time: incremental detokenisation and stop strings,
and each token's own text and bytes (what logprobs show).

Owns only text: it never decides when generation ends except by reporting that a stop string
appeared. It knows nothing of HTTP or of the tiers that produced the tokens.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
# Prompt tokens decoded in front of the first output token, so tokenizers that strip a leading
# space from the start of a decode (SentencePiece) still show the space of the first output word.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def as_decoder(tokenizer: PreTrainedTokenizerBase) -> Decoder:
    """transformers types decode() as returning str | list[str]; for one list of ids it is a str."""
    return cast(Decoder, tokenizer)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the full decode.

    Decodes a small window ids[prefix_offset:] and emits what it adds over ids[prefix_offset:
    read_offset]; the window's left context keeps merges and leading spaces right. Text ending in
    U+FFFD is held back: the next byte-level token usually completes the character; at the end, an
    incomplete one is dropped.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it makes safe to show (often '', never a broken char)."""
        self._ids.append(token_id)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """No more tokens will come: return what is still held back, less a character at the end whose
        bytes never completed (a length cut inside an emoji ends the text before it, not with U+FFFD)."""
        return self._advance(hold_incomplete=False).rstrip(REPLACEMENT_CHAR)

    def _advance(self, *, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text):
            return ""
        if hold_incomplete and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


class StopStringFilter:
    """Holds back text that could begin a stop string; cuts the text before the first one found
    (after it with `include`: vLLM's include_stop_str_in_output)."""

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._include = include
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return the part that is safe to show. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self._pending += text
        found = [(i, n, len(stop)) for n, stop in enumerate(self._stop) if (i := self._pending.find(stop)) >= 0]
        if found:  # the earliest; at one place, the first listed
            cut, _, length = min(found)
            self.stopped = True
            shown, self._pending = self._pending[:cut + (length if self._include else 0)], ""
            return shown
        hold = self._longest_stop_prefix_suffix()
        shown = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(shown):]
        return shown

    def flush(self) -> str:
        """No more text will come: a partial stop string at the end is ordinary text after all."""
        shown, self._pending = ("" if self.stopped else self._pending), ""
        return shown

    def _longest_stop_prefix_suffix(self) -> int:
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; `text` ends just before it and nothing more follows


class OutputText:
    """One request's output text: detokenises each token, then applies the stop strings."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = StopStringFilter(stop, include_stop)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def add_token(self, token_id: int) -> TextDelta:
        if self._stop.stopped:
            return TextDelta("", True)
        text = self._stop.feed(self._detokenizer.add(token_id))
        return TextDelta(text, self._stop.stopped)

    def finish(self) -> TextDelta:
        """The last token has been added: release held-back text (stop strings still apply to it)."""
        if self._stop.stopped:
            return TextDelta("", True)
        text = self._stop.feed(self._detokenizer.flush())
        if self._stop.stopped:
            return TextDelta(text, True)
        return TextDelta(text + self._stop.flush(), False)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


class TokenStrings:
    """Each token's own text and bytes, for logprobs: the token decoded alone (special tokens shown),
    and the bytes it stands for, which a token holding part of a character has even though its text
    is U+FFFD. Cached per token id (at most the vocabulary)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._known: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._strings(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _strings(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        if isinstance(piece, str):
            if (byte := BYTE_FALLBACK_PIECE.fullmatch(piece)) is not None:
                return text, [int(byte[1], 16)]
            if self._byte_level and all(c in BYTE_LEVEL_ALPHABET for c in piece):
                return text, [BYTE_LEVEL_ALPHABET[c] for c in piece]
        return text, list(text.encode("utf-8"))
