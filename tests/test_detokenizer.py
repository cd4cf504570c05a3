"""Incremental detokenisation and stop strings: what a streaming client sees, token by token."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.http.detokenizer import IncrementalDetokenizer, OutputText, StopStringFilter
from shared.models import load_tokenizer, resolve_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧‍👦 in one line",
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "mixed: café naïve Zürich — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
    "  leading spaces\n\n\ttabs and\r\nnewlines   ",
]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny"))


def _stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.flush()]


def _token_ids(tokenizer):
    """Ids biased towards byte tokens and specials, where merges and broken characters happen."""
    vocab = len(tokenizer)
    byte_ids = sorted({i for ch in "é😀中👍🏽" for i in tokenizer.encode(ch)})
    special_ids = sorted(tokenizer.all_special_ids)
    return st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_ids), st.sampled_from(special_ids)),
                    max_size=40)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode_for_random_ids(tokenizer, skip_special_tokens):
    @SETTINGS
    @given(ids=_token_ids(tokenizer))
    def check(ids):
        deltas = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
        # all of it, but a character at the end whose bytes never completed
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")

    check()


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_whole_characters_only(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # no half of a multi-byte character ever shown


def test_character_split_across_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should need several byte-level tokens"
    deltas = _stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "😀" and deltas[-1] == ""


def test_an_unfinished_character_at_the_end_is_held_back_for_good(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # a length cut inside the emoji
    deltas = _stream(tokenizer, ids)
    assert tokenizer.decode(ids).endswith("\ufffd")
    assert "".join(deltas) == "ok " and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_does_not_change_the_output_text(tokenizer, text):
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids, prompt_ids)) == text


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = tokenizer.encode("a b", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, ids)) == "a b"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == "a b" + tokenizer.eos_token


# --- stop strings -----------------------------------------------------------------------------


def _feed(stop, pieces) -> tuple[str, bool]:
    f = StopStringFilter(stop)
    shown = "".join(f.feed(p) for p in pieces)
    return shown + f.flush(), f.stopped


def test_stop_string_cuts_the_text_before_it():
    assert _feed(["END"], ["Hello END world"]) == ("Hello ", True)


def test_stop_string_split_across_pieces_is_found_and_never_shown():
    f = StopStringFilter(["</answer>"])
    assert f.feed("42 </") == "42 "  # "</" could begin the stop string: held back
    assert f.feed("ans") == ""
    assert f.feed("wer> more") == ""
    assert f.stopped


def test_held_back_text_is_released_when_it_stops_matching():
    f = StopStringFilter(["STOP"])
    assert f.feed("a ST") == "a "
    assert f.feed("ART") == "START"
    assert not f.stopped


def test_partial_stop_string_at_the_end_is_released_by_flush():
    assert _feed(["STOP"], ["the end ST"]) == ("the end ST", False)


def test_earliest_of_several_stop_strings_wins():
    assert _feed(["world", "lo"], ["hello world"]) == ("hel", True)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string():
    f = StopStringFilter(["</answer>", "END"], include=True)
    assert f.feed("42 </ans") == "42 " and f.feed("wer> more") == "</answer>" and f.stopped
    f = StopStringFilter(["ab", "a"], include=True)  # two at one place: the first listed
    assert f.feed("xab") == "xab"


def test_stop_string_at_the_very_start_gives_empty_text():
    assert _feed(["\n"], ["\nrest"]) == ("", True)


def test_nothing_is_shown_after_a_stop():
    f = StopStringFilter(["x"])
    f.feed("ax")
    assert f.feed("more") == "" and f.flush() == ""


@SETTINGS
@given(text=st.text(alphabet="abcAB \n", max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=10),
       stop=st.lists(st.text(alphabet="abcAB \n", min_size=1, max_size=4), min_size=1, max_size=4))
def test_stop_filter_cuts_where_a_search_after_each_piece_would(text, cuts, stop):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # Generation stops at the first piece (token) that completes any stop string, so a longer stop
    # string that would have started earlier but completes later never gets the chance.
    expected = (text, False)
    for end in bounds[1:]:
        starts = [i for i in (text[:end].find(s) for s in stop) if i >= 0]
        if starts:
            expected = (text[:min(starts)], True)
            break
    assert _feed(stop, pieces) == expected


# --- output text: tokens in, user-visible deltas out -------------------------------------------


def test_stop_string_split_across_tokens_cuts_the_output(tokenizer):
    text = "The answer is 42. Done here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = OutputText(tokenizer, (), ["42. Do"])  # spans several tokens
    deltas = []
    stopped_at = None
    for n, token in enumerate(ids):
        delta = out.add_token(token)
        deltas.append(delta.text)
        if delta.stopped:
            stopped_at = n
            break
    assert "".join(deltas) == "The answer is "
    assert stopped_at == next(n for n in range(len(ids)) if "42. Do" in tokenizer.decode(ids[:n + 1]))
    assert out.add_token(ids[0]).text == "" and out.finish().stopped


def test_output_without_stop_strings_is_the_whole_decode(tokenizer):
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = OutputText(tokenizer, (), ["never-appears"])
    shown = "".join(out.add_token(t).text for t in ids)
    end = out.finish()
    assert shown + end.text == text and not end.stopped


def test_an_unfinished_character_at_the_end_is_neither_shown_nor_matched(tokenizer):
    ids = tokenizer.encode("ab 😀", add_special_tokens=False)[:-1]  # ends inside the emoji
    out = OutputText(tokenizer, (), ["\ufffd"])
    shown = "".join(out.add_token(t).text for t in ids)
    end = out.finish()
    assert shown + end.text == "ab " and not end.stopped
