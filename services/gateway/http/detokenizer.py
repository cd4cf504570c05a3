"""Token ids to user-visible text, one token at a time: incremental detokenisation and stop strings.

Owns only text: it never decides when generation ends except by reporting that a stop string
appeared. It knows nothing of HTTP or of the tiers that produced the tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output token, so tokenizers that strip a leading
# space from the start of a decode (SentencePiece) still show the space of the first output word.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


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
