"""The gateway's OpenAI API: request validation, error statuses, and the response shapes a client sees.

Parsing is tested as pure functions. The HTTP layer runs against a fake dispatcher (a scripted token
stream), so it proves the SSE/JSON shapes, the pdd extension and run.close() without any worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.http.http_errors import error_middleware, error_payload
from services.gateway.http.openai_api import OpenAIHandlers
from services.gateway.http.request_parsing import (
    NOT_HONOURED,
    OPENAI_CHAT_FIELDS,
    OPENAI_COMPLETION_FIELDS,
    InvalidParam,
    ModelNotFound,
    ParsedRequest,
    PayloadTooLarge,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.observe.request_telemetry import tracing_middleware
from services.gateway.run.request_run import GenerationRequest, TokenEvent
from shared.config import CommonConfig, GatewayConfig
from shared.errors import (
    BadRequest,
    DeadlineExceeded,
    PddError,
    PeerGone,
    RequestAborted,
)
from shared.messages import HandoffStats
from shared.metrics import GatewayMetrics
from shared.models import load_tokenizer, resolve_model
from shared.sampling_params import TokenLogprob

MODEL = "tiny-llama"
CONTEXT = 2048
CONFIG = GatewayConfig(
    common=CommonConfig("nats://127.0.0.1:4222", "gateway-test", "INFO", "", 1.0), model="tiny",
    host="127.0.0.1", port=0, default_pipeline="p-rld-md", request_timeout_s=10.0, token_timeout_s=5.0,
    max_body_bytes=64 * 1024, default_max_tokens=32)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny"))


def chat(tokenizer, body: dict, context: int = CONTEXT) -> ParsedRequest:
    return parse_chat_request({"model": MODEL, **body}, tokenizer, MODEL, CONFIG, context)


def completion(tokenizer, body: dict, context: int = CONTEXT) -> ParsedRequest:
    return parse_completion_request({"model": MODEL, **body}, tokenizer, MODEL, CONFIG, context)


USER_HI = [{"role": "user", "content": "hi"}]


# --- parsing: valid requests -------------------------------------------------------------------


def test_chat_request_renders_the_chat_template(tokenizer):
    parsed = chat(tokenizer, {"messages": USER_HI})
    expected = tokenizer.apply_chat_template(USER_HI, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(parsed.prompt_ids) == expected and parsed.kind == "chat"
    assert parsed.sampling.temperature == 1.0 and parsed.sampling.top_p == 1.0 and parsed.sampling.top_k == 0
    assert parsed.sampling.eos_token_ids == (tokenizer.eos_token_id,) and parsed.sampling.stop_token_ids == ()
    assert parsed.sampling.max_tokens == CONFIG.default_max_tokens
    assert not parsed.stream and not parsed.include_usage and parsed.stop == ()
    assert parsed.pipeline is None and parsed.handoff_at is None and parsed.md_kv_delay_s == 0.0


def test_text_content_parts_equal_the_joined_string(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat(tokenizer, {"messages": parts}).prompt_ids == \
        chat(tokenizer, {"messages": [{"role": "user", "content": "a\nb"}]}).prompt_ids


def test_missing_seed_is_drawn_so_every_tier_samples_alike(tokenizer):
    seeds = {chat(tokenizer, {"messages": USER_HI}).sampling.seed for _ in range(5)}
    assert len(seeds) > 1
    assert chat(tokenizer, {"messages": USER_HI, "seed": 7}).sampling.seed == 7


def test_sampling_fields_and_extensions_are_read(tokenizer):
    parsed = chat(tokenizer, {
        "messages": USER_HI, "temperature": 0, "top_p": 0.5, "top_k": 40, "max_completion_tokens": 9,
        "max_tokens": 1000, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "n": 1, "logprobs": None, "user": "ignored",
        "pdd": {"pipeline": "p-md", "handoff_at": 3, "md_kv_delay_ms": 250}})
    s = parsed.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.ignore_eos) == (0.0, 0.5, 40, 9, True)
    assert parsed.stop == ("\n",) and parsed.stream and parsed.include_usage
    assert (parsed.pipeline, parsed.handoff_at, parsed.md_kv_delay_s) == ("p-md", 3, 0.25)


def test_model_may_be_omitted(tokenizer):
    parsed = parse_completion_request({"prompt": "hello"}, tokenizer, MODEL, CONFIG, CONTEXT)
    assert list(parsed.prompt_ids) == tokenizer.encode("hello")


def test_completion_prompt_may_be_token_ids_or_a_batch_of_one(tokenizer):
    assert completion(tokenizer, {"prompt": [5, 6, 7]}).prompt_ids == (5, 6, 7)
    assert completion(tokenizer, {"prompt": [[5, 6]]}).prompt_ids == (5, 6)
    assert completion(tokenizer, {"prompt": ["hello"]}).prompt_ids == tuple(tokenizer.encode("hello"))


def test_one_token_prompt_is_enough(tokenizer):
    assert completion(tokenizer, {"prompt": [5]}).prompt_ids == (5,)


def test_default_max_tokens_shrinks_to_fit_the_context(tokenizer):
    parsed = completion(tokenizer, {"prompt": list(range(20, 40))}, context=30)
    assert parsed.sampling.max_tokens == 10


def test_default_max_tokens_zero_is_the_rest_of_the_context_as_in_vllm(tokenizer):
    config = dataclasses.replace(CONFIG, default_max_tokens=0)
    parsed = parse_completion_request({"prompt": list(range(20, 40))}, tokenizer, MODEL, config, CONTEXT)
    assert parsed.sampling.max_tokens == CONTEXT - 20
    assert completion(tokenizer, {"prompt": list(range(20, 40))}).sampling.max_tokens == CONFIG.default_max_tokens


def test_include_usage_only_counts_when_streaming(tokenizer):
    assert not chat(tokenizer, {"messages": USER_HI, "stream_options": {"include_usage": True}}).include_usage


# --- parsing: bad requests ---------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": USER_HI, "temperature": "hot"}, "temperature"),
    ({"messages": USER_HI, "temperature": True}, "temperature"),
    ({"messages": USER_HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER_HI, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": USER_HI, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": USER_HI, "n": 17}, "n"),
    ({"messages": USER_HI, "seed": 2**64}, "seed"),
    ({"messages": USER_HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER_HI, "stop": [""]}, "stop"),
    ({"messages": USER_HI, "stop": 3}, "stop"),
    ({"messages": USER_HI, "stream": "yes"}, "stream"),
    ({"messages": USER_HI, "stream_options": []}, "stream_options"),
    ({"messages": USER_HI, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER_HI, "stream": True, "stream_options": {"include_usge": True}}, "stream_options.include_usge"),
    ({"messages": USER_HI, "stream": True, "stream_options": {"include_obfuscation": "no"}},
     "stream_options.include_obfuscation"),
    ({"messages": USER_HI, "pdd": {"pipeline": "p-x"}}, "pdd.pipeline"),
    ({"messages": USER_HI, "pdd": {"handoff_at": -1}}, "pdd.handoff_at"),
    ({"messages": USER_HI, "pdd": {"md_kv_delay_ms": -5}}, "pdd.md_kv_delay_ms"),
    ({"messages": USER_HI, "pdd": {"handof_at": 3}}, "pdd"),
    ({"messages": USER_HI, "pdd": "p-md"}, "pdd"),
])
def test_bad_chat_fields_are_refused_naming_the_field(tokenizer, body, param):
    with pytest.raises(InvalidParam) as info:
        chat(tokenizer, body)
    assert info.value.param == param


@pytest.mark.parametrize("body", [
    {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [[1], [2]]}, {"prompt": [1, "a"]},
    {"prompt": [-1]}, {"prompt": [10**9]}, {"prompt": [True]}, {"prompt": None}, {"prompt": {"text": "a"}},
])
def test_bad_completion_prompts_are_refused(tokenizer, body):
    with pytest.raises(InvalidParam) as info:
        completion(tokenizer, body)
    assert info.value.param == "prompt"


NOT_HONOURED_VALUES = {
    "functions": [{"name": "f"}], "function_call": "auto",
    "suffix": "x", "best_of": 2, "prompt_logprobs": 1, "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "x"}, "modalities": ["text", "audio"], "moderation": {"categories": ["violence"]},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low", "guided_json": {},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'", "structured_outputs": {"json": {}},
}


def test_every_field_pdd_does_not_honour_is_listed_with_a_refused_value():
    assert set(NOT_HONOURED_VALUES) == set(NOT_HONOURED)


@pytest.mark.parametrize("name", sorted(NOT_HONOURED_VALUES))
def test_a_field_pdd_does_not_honour_is_refused_naming_it_unless_it_asks_nothing(tokenizer, name):
    for parse in (chat, completion):
        base = {"messages": USER_HI} if parse is chat else {"prompt": "x"}
        with pytest.raises(InvalidParam) as info:
            parse(tokenizer, {**base, name: NOT_HONOURED_VALUES[name]})
        assert info.value.param == name
        for neutral in (None, *NOT_HONOURED[name]):
            assert parse(tokenizer, {**base, name: neutral}).prompt_ids  # null or the default: served


@pytest.mark.parametrize("message, param", [
    ({"role": "function", "content": "42", "name": "f"}, "messages[1].role"),
    ({"role": "robot", "content": "hi"}, "messages[1].role"),
    ({"role": "user"}, "messages[1].content"),
    ({"role": "system", "content": None}, "messages[1].content"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
     "messages[1].tool_calls[0]"),
    ({"role": "tool", "content": 42, "tool_call_id": "c1"}, "messages[1].content"),
])
def test_roles_and_message_shapes_are_checked(tokenizer, message, param):
    with pytest.raises(InvalidParam) as info:
        chat(tokenizer, {"messages": [*USER_HI, message]})
    assert info.value.param == param


def test_developer_and_empty_assistant_turns_are_served(tokenizer):
    messages = [{"role": "developer", "content": "be brief"}, *USER_HI, {"role": "assistant", "content": None},
                *USER_HI]
    assert chat(tokenizer, {"messages": messages}).prompt_ids


@pytest.mark.parametrize("body, param", [({"temperature": 2.01}, "temperature"), ({"temperature": -0.1}, "temperature"),
                                         ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p")])
def test_sampling_ranges_are_openais_and_name_the_field(tokenizer, body, param):
    with pytest.raises(InvalidParam) as info:
        completion(tokenizer, {"prompt": "x", **body})
    assert info.value.param == param
    assert completion(tokenizer, {"prompt": "x", "temperature": 2.0, "top_p": 1.0}).sampling.temperature == 2.0


def test_stop_token_ids_min_tokens_and_include_stop_str_are_parsed(tokenizer):
    parsed = completion(tokenizer, {"prompt": "x", "stop_token_ids": [5, 9, 5], "min_tokens": 3, "max_tokens": 8,
                                    "include_stop_str_in_output": True, "stop": "END"})
    assert parsed.sampling.stop_token_ids == (5, 9) and parsed.sampling.min_tokens == 3
    assert parsed.include_stop and parsed.stop == ("END",)
    plain = completion(tokenizer, {"prompt": "x"})
    assert (plain.sampling.stop_token_ids, plain.sampling.min_tokens, plain.include_stop) == ((), 0, False)


@pytest.mark.parametrize("body, param", [
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_bad_stop_and_min_tokens_values_name_their_field(tokenizer, body, param):
    with pytest.raises(InvalidParam) as info:
        completion(tokenizer, {"prompt": "x", **body})
    assert info.value.param == param


def test_penalties_logit_bias_and_min_p_are_read(tokenizer):
    s = completion(tokenizer, {"prompt": "x", "presence_penalty": -2, "frequency_penalty": 1.5,
                               "repetition_penalty": 1.3, "logit_bias": {"50": -100, "7": 2.5}, "min_p": 0.2}).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (-2.0, 1.5, 1.3, 0.2)
    assert s.logit_bias == {50: -100.0, 7: 2.5}
    plain = completion(tokenizer, {"prompt": "x"}).sampling
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty, plain.logit_bias,
            plain.min_p, plain.logprobs) == (0.0, 0.0, 1.0, {}, 0.0, None)


def test_chat_logprobs_and_top_logprobs_are_read(tokenizer):
    assert chat(tokenizer, {"messages": USER_HI, "logprobs": True, "top_logprobs": 20}).sampling.logprobs == 20
    assert chat(tokenizer, {"messages": USER_HI, "logprobs": True}).sampling.logprobs == 0
    for off in ({"logprobs": False}, {"logprobs": False, "top_logprobs": 0}, {"top_logprobs": None}, {}):
        assert chat(tokenizer, {"messages": USER_HI, **off}).sampling.logprobs is None


def test_completion_logprobs_count_the_alternatives(tokenizer):
    assert completion(tokenizer, {"prompt": "x", "logprobs": 5}).sampling.logprobs == 5
    assert completion(tokenizer, {"prompt": "x", "logprobs": 0}).sampling.logprobs == 0  # the chosen token's only
    assert completion(tokenizer, {"prompt": "x", "logprobs": None}).sampling.logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": "x"}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"), ({"repetition_penalty": "x"}, "repetition_penalty"),
    ({"logit_bias": "x"}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"50": 101}}, "logit_bias"), ({"logit_bias": {"50": -100.5}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"), ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": "x"}, "min_p"),
])
def test_bad_penalties_bias_and_min_p_name_their_field(tokenizer, body, param):
    for parse, base in ((chat, {"messages": USER_HI}), (completion, {"prompt": "x"})):
        with pytest.raises(InvalidParam) as info:
            parse(tokenizer, {**base, **body})
        assert info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 1}, "logprobs"), ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_chat_logprobs_name_their_field(tokenizer, body, param):
    with pytest.raises(InvalidParam) as info:
        chat(tokenizer, {"messages": USER_HI, **body})
    assert info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_completion_logprobs_name_their_field(tokenizer, body, param):
    with pytest.raises(InvalidParam) as info:
        completion(tokenizer, {"prompt": "x", **body})
    assert info.value.param == param


def test_bad_sampling_values_are_refused(tokenizer):
    for body in ({"temperature": -0.5}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(BadRequest):
            completion(tokenizer, {"prompt": "x", **body})


def test_unknown_model_is_not_found(tokenizer):
    with pytest.raises(ModelNotFound) as info:
        parse_chat_request({"model": "gpt-4", "messages": USER_HI}, tokenizer, MODEL, CONFIG, CONTEXT)
    status, body = error_payload(info.value)
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_prompt_longer_than_the_context_is_refused(tokenizer):
    with pytest.raises(BadRequest, match="at most 9"):
        completion(tokenizer, {"prompt": list(range(100, 110))}, context=10)
    assert completion(tokenizer, {"prompt": list(range(100, 109))}, context=10).sampling.max_tokens == 1


def test_explicit_max_tokens_that_cannot_fit_is_refused(tokenizer):
    with pytest.raises(BadRequest, match="exceeds"):
        completion(tokenizer, {"prompt": list(range(100, 110)), "max_tokens": 21}, context=30)
    assert completion(tokenizer, {"prompt": list(range(100, 110)), "max_tokens": 20}, context=30)


def test_body_must_be_a_json_object(tokenizer):
    for body in ([], "x", 3, None):
        with pytest.raises(BadRequest, match="JSON object"):
            parse_chat_request(body, tokenizer, MODEL, CONFIG, CONTEXT)


@pytest.mark.parametrize("raw, says", [
    (b'{"model": ', "unexpected end of data at line 1 column 11"),
    (b'{"prompt": "\xff\xfe"}', "byte 12 (0xff) is not UTF-8"),
    (b'{"prompt": "\xed\xa0\x80"}', "byte 12 (0xed) is not UTF-8"),  # an encoded surrogate, as orjson words it
    (b"[" * 100_000, "it nests arrays and objects deeper than 1024 levels"),
    (b"", "the body is empty"),
])
def test_a_body_that_is_not_utf8_json_says_so_and_where(raw, says):
    with pytest.raises(BadRequest) as info:
        decode_json_body(raw, 10**6)
    assert str(info.value) == f"the request body is not valid UTF-8 JSON: {says}"
    assert getattr(info.value, "param", None) is None and "surrogates" not in str(info.value)


def test_oversized_json_is_refused():
    with pytest.raises(PayloadTooLarge):
        decode_json_body(b" " * 101, 100)
    assert decode_json_body(b'{"a": 1}', 100) == {"a": 1}


@pytest.mark.parametrize("kind, body, param, says", [
    ("chat", {"messages": USER_HI, "foo": 1}, "foo", "unknown field 'foo'"),
    ("chat", {"messages": USER_HI, "max_token": 3}, "max_token", "'max_token' (did you mean 'max_tokens'?)"),
    ("chat", {"messages": USER_HI, "zeta": 1, "alpha": None}, "alpha", "unknown fields 'alpha', 'zeta'"),
    ("chat", {"messages": USER_HI, "prompt": "x"}, "prompt", "unknown field 'prompt'"),
    ("completion", {"prompt": "x", "tools": []}, "tools", "unknown field 'tools'"),
    ("completion", {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens", "unknown field"),
    ("completion", {"prompt": "x", "max_token": 3}, "max_token", "did you mean 'max_tokens'?"),
])
def test_unknown_fields_are_refused_naming_them(tokenizer, kind, body, param, says):
    """A typo is told, never served as if the field were absent (issue 42: "max_token" made 30 tokens)."""
    with pytest.raises(InvalidParam) as info:
        (chat if kind == "chat" else completion)(tokenizer, body)
    assert info.value.param == param and says in str(info.value)


def test_every_field_the_openai_client_sends_is_known_and_documented_vendor_fields_too(tokenizer):
    import typing

    from openai.types import completion_create_params as completions_params
    from openai.types.chat import completion_create_params as chat_params

    assert set(typing.get_type_hints(chat_params.CompletionCreateParamsBase)) | {"stream"} == set(OPENAI_CHAT_FIELDS)
    assert set(typing.get_type_hints(completions_params.CompletionCreateParamsBase)) | {"stream"} == \
        set(OPENAI_COMPLETION_FIELDS)
    vendor = {"pdd": {"pipeline": "p-md"}, "top_k": 5, "ignore_eos": False, "stop_token_ids": [2], "min_tokens": 1,
              "include_stop_str_in_output": False, "repetition_penalty": 1.1, "min_p": 0.1}
    format_fields = {"response_format": {"type": "json_object"}, **vendor, "min_tokens": 0}
    assert chat(tokenizer, {"messages": USER_HI, **vendor}).sampling.top_k == 5
    assert completion(tokenizer, {"prompt": "x", **format_fields}).sampling.min_p


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | _json,
    "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10) | _json}), max_size=3) | _json,
})
_fields = {
    "model": st.just(MODEL) | _json,
    "messages": st.lists(_message | _json, max_size=3) | _json,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=40)
    | st.lists(st.text(max_size=5), max_size=2) | _json,
    "max_tokens": st.integers(-2, 5000) | _json,
    "max_completion_tokens": st.integers(-2, 5000) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-0.5, 1.5) | _json,
    "top_k": st.integers(-3, 100) | _json,
    "seed": st.integers(-(2**64), 2**64) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | _json,
    "n": st.integers(0, 3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "ignore_eos": st.booleans() | _json,
    "presence_penalty": st.floats(-3, 3) | _json,
    "repetition_penalty": st.floats(-1, 3) | _json,
    "logit_bias": st.dictionaries(st.integers(-2, 60000).map(str) | st.text(max_size=3),
                                  st.floats(-120, 120) | _json, max_size=3) | _json,
    "min_p": st.floats(-0.5, 1.5) | _json,
    "logprobs": st.booleans() | st.integers(-1, 25) | _json,
    "top_logprobs": st.integers(-1, 25) | _json,
    "pdd": st.fixed_dictionaries({}, optional={
        "pipeline": st.sampled_from(["p-md", "p-rld-md", "x"]) | _json,
        "handoff_at": st.integers(-2, 50) | _json,
        "md_kv_delay_ms": st.floats(-10, 1e6) | _json,
    }) | _json,
}
_bodies = st.fixed_dictionaries({}, optional=_fields) | _json


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, is_chat=st.booleans(), context=st.sampled_from([8, 64, CONTEXT]))
def test_any_body_parses_or_raises_bad_request(tokenizer, body, is_chat, context):
    parse = parse_chat_request if is_chat else parse_completion_request
    try:
        parsed = parse(body, tokenizer, MODEL, CONFIG, context)
    except BadRequest:
        return
    assert 1 <= len(parsed.prompt_ids) <= context - 1
    assert 1 <= parsed.sampling.max_tokens <= context - len(parsed.prompt_ids)
    assert len(parsed.stop) <= 4 and all(parsed.stop)
    orjson.dumps(parsed.sampling.to_dict())  # what the dispatcher sends to the workers must serialise


# --- error statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize("exc, status, code", [
    (BadRequest("bad"), 400, "invalid_request_error"),
    (InvalidParam("top_p", "bad"), 400, "invalid_request_error"),
    (ModelNotFound("model", "no"), 404, "model_not_found"),
    (PayloadTooLarge("big"), 413, "payload_too_large"),
    (web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20), 413, "payload_too_large"),
    (PeerGone("no relay"), 503, "peer_unavailable"),
    (DeadlineExceeded("slow"), 504, "deadline_exceeded"),
    (RequestAborted("tier failed"), 500, "aborted"),
    (PddError("odd"), 500, "internal_error"),
    (KeyError("bug"), 500, "internal_error"),
])
def test_errors_map_to_openai_shaped_statuses(exc, status, code):
    got_status, body = error_payload(exc)
    assert got_status == status
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if isinstance(exc, KeyError):
        assert "bug" not in body["error"]["message"]  # internals stay in the log


# --- HTTP layer against a fake dispatcher -------------------------------------------------------


class FakeRun:
    """A scripted token stream: `relay_tokens` from RLD first, then MD, with handoff stats."""

    def __init__(self, req: GenerationRequest, token_ids: list[int], finish: str, relay_tokens: int,
                 fail_at: int | None, endless: bool, stall_at: int | None,
                 first_token_gate: asyncio.Event | None = None) -> None:
        self.request_id = req.request_id
        self.pipeline = req.pipeline or "p-rld-md"
        self.cached_tokens = 3
        self.handoff: HandoffStats | None = None
        self.cut_index = relay_tokens or None  # the run decides the cut; the HTTP layer reads it
        self.prefill = None  # P's report never comes: choices 1... start when choice 0 has finished
        self.recovery = None
        self._first_token_gate = first_token_gate
        self.close_reasons: list[str] = []
        self.closed = asyncio.Event()
        self._token_ids, self._finish, self._relay_tokens = token_ids, finish, relay_tokens
        self._fail_at, self._endless, self._stall_at = fail_at, endless, stall_at
        self._top_logprobs = req.sampling.logprobs

    def _logprob(self, i: int, token: int) -> TokenLogprob | None:
        """A made-up distribution: token i at logprob -(i+1)/8, tokens 100, 101, ... likelier."""
        if self._top_logprobs is None:
            return None
        return TokenLogprob(fake_logprob(i), tuple((100 + k, -k / 16) for k in range(self._top_logprobs)))

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        if self._first_token_gate is not None:
            await self._first_token_gate.wait()  # prefill
        for i, token in enumerate(self._token_ids):
            if i == self._fail_at:
                raise PeerGone("main decode went away")
            if i == self._stall_at:
                await asyncio.Event().wait()
            tier = "relay" if i < self._relay_tokens else "main"
            if tier == "main" and self._relay_tokens and self.handoff is None:
                self.handoff = HandoffStats(self.request_id, i, 0.01, 0.002, 0.003)
            last = i == len(self._token_ids) - 1 and not self._endless
            await asyncio.sleep(0.005 if self._endless else 0)
            yield TokenEvent(i, token, tier, self._finish if last else None, self._logprob(i, token))
        while self._endless:
            await asyncio.sleep(0.005)
            yield TokenEvent(len(self._token_ids), self._token_ids[0], "main", None)

    def summary(self) -> dict:
        return {"pipeline": self.pipeline, "cached_tokens": {"prefill": self.cached_tokens, "main": 0}}

    async def close(self, reason: str) -> None:
        self.close_reasons.append(reason)
        self.closed.set()


def fake_logprob(i: int) -> float:
    return -(i + 1) / 8


class FakeDispatcher:
    def __init__(self, tokenizer, text: str = "", finish: str = "stop", relay_tokens: int = 0,
                 fail_at: int | None = None, unavailable: bool = False, endless: bool = False,
                 stall_at: int | None = None, first_token_gate: asyncio.Event | None = None) -> None:
        self.token_ids = tokenizer.encode(text, add_special_tokens=False)
        if finish == "stop":
            self.token_ids.append(tokenizer.eos_token_id)
        self.finish, self.relay_tokens, self.fail_at = finish, relay_tokens, fail_at
        self.unavailable, self.endless, self.stall_at = unavailable, endless, stall_at
        self.first_token_gate = first_token_gate
        self.requests: list[GenerationRequest] = []
        self.runs: list[FakeRun] = []

    async def start(self, req: GenerationRequest) -> FakeRun:
        if self.unavailable:
            raise PeerGone("no prefill instance is alive")
        self.requests.append(req)
        self.runs.append(FakeRun(req, self.token_ids, self.finish, self.relay_tokens, self.fail_at, self.endless,
                                 self.stall_at, self.first_token_gate))
        return self.runs[-1]


@contextlib.asynccontextmanager
async def serve(dispatcher: FakeDispatcher, tokenizer, client_max_size: int = 1024**2,
                handler_cancellation: bool = False, config: GatewayConfig = CONFIG,
                metrics: GatewayMetrics | None = None):
    """The app as the gateway runs it (aiohttp's TestServer would always cancel handlers on disconnect);
    with `metrics`, its tracing middleware counts the responses in them."""
    handlers = OpenAIHandlers(dispatcher, tokenizer, MODEL, config, CONTEXT)
    middlewares = [error_middleware] if metrics is None else [error_middleware, tracing_middleware(metrics)]
    app = web.Application(middlewares=middlewares, client_max_size=client_max_size)
    app.add_routes(handlers.routes())
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def openai_client(base_url: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


TEXT = "Bonjour 😀! 日本語 works. The end."


async def test_streamed_chat_marks_every_token_with_its_tier_and_the_handoff(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="stop", relay_tokens=4)
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=USER_HI, stream=True, stream_options={"include_usage": True},
            extra_body={"pdd": {"pipeline": "p-rld-md", "handoff_at": 4}})
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [t for c in chunks if c.model_extra.get("pdd") for t in c.model_extra["pdd"]["tokens"]]
    assert [t["index"] for t in tokens] == list(range(len(dispatcher.token_ids)))
    assert [t["tier"] for t in tokens] == ["relay"] * 4 + ["main"] * (len(dispatcher.token_ids) - 4)
    handoffs = [(n, c.model_extra["pdd"]["handoff"]) for n, c in enumerate(chunks)
                if "handoff" in (c.model_extra.get("pdd") or {})]
    assert len(handoffs) == 1 and handoffs[0][1]["eager_tokens"] == 4
    assert chunks[handoffs[0][0]].model_extra["pdd"]["tokens"] == [
        {"index": 4, "id": dispatcher.token_ids[4], "tier": "main"}]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(dispatcher.token_ids)
    assert usage.prompt_tokens == len(dispatcher.requests[0].prompt_ids)
    assert usage.prompt_tokens_details.cached_tokens == 3
    req = dispatcher.requests[0]
    assert req.request_id.startswith("req-") and req.pipeline == "p-rld-md" and req.handoff_at == 4
    assert dispatcher.runs[0].close_reasons == ["finished"]


async def test_no_chunk_is_streamed_before_the_first_token(tokenizer):
    """A client times its first chunk as the TTFT: the role rides on the first token's chunk. The
    status line goes out with it too (a failure before it is an HTTP error)."""
    gate = asyncio.Event()
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="stop", first_token_gate=gate)
    body = {"model": MODEL, "messages": USER_HI, "stream": True}
    async with serve(dispatcher, tokenizer) as url, aiohttp.ClientSession() as session:
        response = asyncio.create_task(session.post(url + "/chat/completions", json=body))
        await asyncio.sleep(0.3)
        assert not response.done(), "nothing is sent before the first token"
        gate.set()
        async with await response as r:
            assert r.status == 200
            first = orjson.loads((await r.content.readuntil(b"\n\n")).removeprefix(b"data: "))
            second = orjson.loads((await r.content.readuntil(b"\n\n")).removeprefix(b"data: "))
    first_text = tokenizer.decode(dispatcher.token_ids[:1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": first_text}
    assert first["pdd"]["tokens"][0]["index"] == 0
    assert "role" not in second["choices"][0]["delta"] and second["pdd"]["tokens"][0]["index"] == 1


async def test_completion_with_stop_string_cuts_text_and_counts_tokens_to_the_stop(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="length", relay_tokens=2)
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        result = await client.completions.create(model=MODEL, prompt="Say hi", stop=["works"], max_tokens=50)
    assert result.choices[0].text == "Bonjour 😀! 日本語 " and result.choices[0].finish_reason == "stop"
    ids = dispatcher.token_ids
    through_stop = next(n for n in range(1, len(ids) + 1) if "works" in tokenizer.decode(ids[:n]))
    assert result.usage.completion_tokens == through_stop
    assert result.model_extra["pdd"]["tokens_by_tier"] == {"relay": 2, "main": through_stop - 2}
    assert result.model_extra["pdd"]["handoff"]["eager_tokens"] == 2
    assert dispatcher.runs[0].close_reasons == ["stop_string"]


async def test_non_streamed_chat_reports_length_and_usage(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="length")
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        result = await client.chat.completions.create(model=MODEL, messages=USER_HI, max_tokens=50)
    assert result.choices[0].message.content == TEXT and result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == len(dispatcher.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.model_extra["pdd"] == {"pipeline": "p-rld-md", "handoff": None,
                                         "cached_tokens": {"prefill": 3, "main": 0},
                                         "tokens_by_tier": {"relay": 0, "main": len(dispatcher.token_ids)}}


async def test_models_lists_the_served_model(tokenizer):
    async with serve(FakeDispatcher(tokenizer), tokenizer) as url, openai_client(url) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_one_model_by_id_and_a_fingerprint_in_every_response(tokenizer):
    async with serve(FakeDispatcher(tokenizer, TEXT), tokenizer) as url, openai_client(url) as client:
        model = await client.models.retrieve(MODEL)
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-4")
        result = await client.chat.completions.create(model=MODEL, messages=USER_HI)
        stream = await client.chat.completions.create(model=MODEL, messages=USER_HI, stream=True)
        chunks = [chunk async for chunk in stream]
    assert model.id == MODEL and info.value.code == "model_not_found"
    assert result.system_fingerprint and result.system_fingerprint.startswith("pdd-")
    assert {chunk.system_fingerprint for chunk in chunks} == {result.system_fingerprint}


async def test_a_field_pdd_cannot_honour_is_a_400_naming_it_through_the_client(tokenizer):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    async with serve(FakeDispatcher(tokenizer, TEXT), tokenizer) as url, openai_client(url) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, tools=[tool], tool_choice="maybe")
        assert info.value.param == "tool_choice"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, response_format={"type": "yaml"})
        assert info.value.param == "response_format.type"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, functions=[{"name": "f"}])
        assert info.value.param == "functions"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, temperature=5)
        assert info.value.param == "temperature"
        result = await client.chat.completions.create(model=MODEL, messages=USER_HI, logprobs=False,
                                                      presence_penalty=0, response_format={"type": "text"})
    assert result.choices[0].message.content == TEXT  # the neutral values ask for nothing: served


async def test_chat_logprobs_have_openais_shape_streamed_and_not(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="stop")
    ids = dispatcher.token_ids
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        full = await client.chat.completions.create(model=MODEL, messages=USER_HI, logprobs=True, top_logprobs=3)
        stream = await client.chat.completions.create(model=MODEL, messages=USER_HI, logprobs=True, top_logprobs=3,
                                                      stream=True)
        chunks = [chunk async for chunk in stream]
        plain = await client.chat.completions.create(model=MODEL, messages=USER_HI)
    assert dispatcher.requests[0].sampling.logprobs == 3 and plain.choices[0].logprobs is None
    content = full.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]  # EOS included: a counted token
    assert [c.logprob for c in content] == [fake_logprob(i) for i in range(len(ids))]
    assert b"".join(bytes(c.bytes) for c in content[:-1]).decode() == TEXT  # whole characters from the bytes
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
        [[(tokenizer.decode([100 + k]), -k / 16) for k in range(3)]] * len(ids)
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert streamed == content
    assert all(len(chunk.choices[0].logprobs.content) == 1 for chunk in chunks
               if chunk.choices and chunk.choices[0].finish_reason is None)


async def test_completion_logprobs_list_tokens_alternatives_and_offsets(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="length")
    ids = dispatcher.token_ids
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        full = await client.completions.create(model=MODEL, prompt="x", logprobs=2, max_tokens=50)
        stream = await client.completions.create(model=MODEL, prompt="x", logprobs=2, max_tokens=50, stream=True)
        chunks = [chunk async for chunk in stream]
    logprobs = full.choices[0].logprobs
    tokens = [tokenizer.decode([t]) for t in ids]
    assert logprobs.tokens == tokens
    assert logprobs.token_logprobs == [fake_logprob(i) for i in range(len(ids))]
    # the two likeliest, and always the chosen token
    assert logprobs.top_logprobs[0] == {tokenizer.decode([100]): 0.0, tokenizer.decode([101]): -1 / 16,
                                        tokens[0]: fake_logprob(0)}
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    parts = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == logprobs.text_offset


async def test_logprobs_cover_every_counted_token_when_a_stop_string_cuts_the_text(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, finish="length")
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        result = await client.completions.create(model=MODEL, prompt="x", stop=["works"], logprobs=0, max_tokens=50)
    logprobs = result.choices[0].logprobs
    assert result.choices[0].text == "Bonjour 😀! 日本語 "
    assert len(logprobs.tokens) == result.usage.completion_tokens  # up to the token that completed "works"
    assert "".join(logprobs.tokens).endswith("works")
    assert all(len(top) == 1 for top in logprobs.top_logprobs)  # logprobs 0: the chosen token only


async def test_no_instance_is_503_with_retry_after(tokenizer):
    async with serve(FakeDispatcher(tokenizer, unavailable=True), tokenizer) as url, openai_client(url) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"
    assert info.value.body["code"] == "peer_unavailable"


async def test_a_stream_that_fails_before_its_first_token_is_a_503_with_retry_after(tokenizer):
    """Nothing of the answer was sent: the failure is the response's status, as it is unstreamed."""
    dispatcher = FakeDispatcher(tokenizer, TEXT, fail_at=0)
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, stream=True)
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"
    assert info.value.body["code"] == "peer_unavailable" and info.value.body["message"] == "main decode went away"
    assert dispatcher.runs[0].close_reasons == ["error"]


async def test_the_response_metric_counts_a_failed_stream_by_its_errors_status(tokenizer):
    metrics = GatewayMetrics()
    dispatcher = FakeDispatcher(tokenizer, TEXT, fail_at=3)
    async with serve(dispatcher, tokenizer, metrics=metrics) as url, openai_client(url) as client:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model=MODEL, messages=USER_HI)  # unstreamed: a 503
        stream = await client.chat.completions.create(model=MODEL, messages=USER_HI, stream=True)
        with pytest.raises(openai.APIError, match="main decode went away"):
            async for _ in stream:
                pass

    def responses(status: str) -> float | None:
        return metrics.registry.get_sample_value("pdd_http_responses_total",
                                                 {"route": "/v1/chat/completions", "status": status})

    assert (responses("200"), responses("503")) == (None, 2.0)


async def test_unknown_model_is_404_through_the_client(tokenizer):
    async with serve(FakeDispatcher(tokenizer), tokenizer) as url, openai_client(url) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="gpt-4", messages=USER_HI)
    assert info.value.code == "model_not_found"


async def test_failure_mid_stream_arrives_as_an_error_event(tokenizer):
    dispatcher = FakeDispatcher(tokenizer, TEXT, fail_at=3)
    async with serve(dispatcher, tokenizer) as url, openai_client(url) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=USER_HI, stream=True)
        with pytest.raises(openai.APIError, match="main decode went away"):
            async for _ in stream:
                pass
    assert dispatcher.runs[0].close_reasons == ["error"]


async def test_raw_http_errors_have_the_openai_shape(tokenizer):
    async with serve(FakeDispatcher(tokenizer), tokenizer, client_max_size=128 * 1024) as url, \
            aiohttp.ClientSession() as session:
        async def post(path: str, data: bytes) -> tuple[int, dict]:
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

        status, body = await post("/chat/completions", b'{"messages": [')
        assert status == 400 and "not valid UTF-8 JSON" in body["error"]["message"]
        status, body = await post("/chat/completions", b'{"messages": [{"role": "user", "content": "\xff"}]}')
        assert status == 400 and body["error"]["param"] is None
        assert body["error"]["message"] == "the request body is not valid UTF-8 JSON: byte 43 (0xff) is not UTF-8"
        status, body = await post("/completions", b"[1, 2]")
        assert status == 400 and "JSON object" in body["error"]["message"]
        status, body = await post("/completions", b'{"prompt": "' + b"a" * CONFIG.max_body_bytes + b'"}')
        assert status == 413 and body["error"]["code"] == "payload_too_large"
        async with session.get(url + "/nowhere") as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_body_over_the_app_limit_is_413_json(tokenizer):
    async with serve(FakeDispatcher(tokenizer), tokenizer, client_max_size=1024) as url, \
            aiohttp.ClientSession() as session:
        async with session.post(url + "/completions", data=b'{"prompt": "' + b"a" * 4096 + b'"}') as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_client_disconnect_mid_stream_closes_the_run(tokenizer, handler_cancellation):
    dispatcher = FakeDispatcher(tokenizer, TEXT, endless=True)
    async with serve(dispatcher, tokenizer, handler_cancellation=handler_cancellation) as url:
        async with aiohttp.ClientSession() as session:
            r = await session.post(url + "/completions", json={"prompt": "x", "stream": True, "max_tokens": 1000})
            await r.content.readuntil(b"\n\n")
            r.close()  # drop the connection without reading on
        async with asyncio.timeout(5):
            await dispatcher.runs[0].closed.wait()
    assert dispatcher.runs[0].close_reasons == ["client_disconnected"]


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_client_disconnect_while_waiting_for_a_whole_completion_closes_the_run(tokenizer,
                                                                                   handler_cancellation):
    dispatcher = FakeDispatcher(tokenizer, TEXT, endless=True)
    async with serve(dispatcher, tokenizer, handler_cancellation=handler_cancellation) as url:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
            with pytest.raises(TimeoutError):
                await session.post(url + "/completions", json={"prompt": "x", "max_tokens": 1000})
        async with asyncio.timeout(5):
            await dispatcher.runs[0].closed.wait()
    assert dispatcher.runs[0].close_reasons == ["client_disconnected"]


async def test_a_token_stream_stalled_past_the_request_deadline_is_504(tokenizer):
    """(The next-token deadline is the run's: tests/test_request_run.py.)"""
    dispatcher = FakeDispatcher(tokenizer, TEXT, stall_at=2)
    config = dataclasses.replace(CONFIG, request_timeout_s=0.3)
    async with serve(dispatcher, tokenizer, config=config) as url, openai_client(url) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 504 and info.value.body["code"] == "deadline_exceeded"
    assert dispatcher.runs[0].close_reasons == ["error"]


# --- tools and response_format: parsing, and the answer read for tool calls ---------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_response_format_and_forced_tool_calls_travel_as_a_constraint(tokenizer):
    plain = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER]})
    assert plain.sampling.constraint is None and plain.reads_tool_calls  # auto: read, not forced
    forced = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER], "tool_choice": "required"})
    assert forced.sampling.constraint["kind"] == "tool_calls"
    named = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER],
                             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.sampling.constraint["kind"] == "tool_calls"
    none = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER], "tool_choice": "none"})
    assert none.sampling.constraint is None and not none.reads_tool_calls
    assert "get_weather" not in tokenizer.decode(none.prompt_ids)  # "none": the tools stay out of the prompt
    assert "get_weather" in tokenizer.decode(plain.prompt_ids)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    for parse, base in ((chat, {"messages": USER_HI}), (completion, {"prompt": "x"})):
        assert parse(tokenizer, {**base, "response_format": schema}).sampling.constraint["kind"] == "json_schema"
        assert parse(tokenizer, {**base, "response_format": {"type": "json_object"}}).sampling.constraint


def test_tools_beside_response_format_are_one_grammar_of_calls_or_the_answer(tokenizer):
    """OpenAI's behaviour (openai-agents' output_type with tools, pydantic-ai's NativeOutput with tools):
    "auto" answers with calls or JSON in the format; a forced call is a call, the format for a later turn."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "ok": {"type": "boolean"}}}}}
    auto = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER], "response_format": schema})
    assert auto.sampling.constraint["kind"] == "tool_calls_or_json" and auto.reads_tool_calls
    required = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER], "response_format": schema,
                                "tool_choice": "required"})
    assert required.sampling.constraint == chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER],
                                                            "tool_choice": "required"}).sampling.constraint
    none = chat(tokenizer, {"messages": USER_HI, "tools": [WEATHER], "response_format": schema, "tool_choice": "none"})
    assert none.sampling.constraint["kind"] == "json_schema" and not none.reads_tool_calls


def test_tool_history_is_rendered_through_the_template(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    parsed = chat(tokenizer, {"messages": [*USER_HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                              "tools": [WEATHER]})
    text = tokenizer.decode(parsed.prompt_ids)
    assert '"city": "Paris"' in text and "<tool_response>" in text and "sunny" in text


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strange"}}}}, "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object", "schema": {"type": "strange"}}},
     "response_format.schema"),
    ({"messages": [*USER_HI, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "response_format.json_schema.schema"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_and_format_requests_name_the_field(tokenizer, extra, param):
    with pytest.raises(BadRequest) as info:
        chat(tokenizer, {"messages": USER_HI, **extra})
    assert getattr(info.value, "param", None) == param


async def test_a_tool_call_in_the_answer_comes_back_as_tool_calls_whole_and_streamed(tokenizer):
    text = "Let me check. " + CALL_TEXT
    async with serve(FakeDispatcher(tokenizer, text), tokenizer) as url, openai_client(url) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=USER_HI, tools=[WEATHER])
        stream = await client.chat.completions.create(model=MODEL, messages=USER_HI, tools=[WEATHER], stream=True)
        chunks = [chunk async for chunk in stream]
        plain = await client.chat.completions.create(model=MODEL, messages=USER_HI, tools=[WEATHER],
                                                     tool_choice="none")
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert streamed[0].id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_call_cut_by_max_tokens_is_a_cut_tool_call_in_every_choice(tokenizer, stream):
    """Issue 42: the call came back as `<tool_call>` text in content. As OpenAI: tool_calls, its
    arguments as far as they came, finish_reason "length", for each of n choices."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    async with serve(FakeDispatcher(tokenizer, text, finish="length"), tokenizer) as url, \
            openai_client(url) as client:
        request = dict(model=MODEL, messages=USER_HI, tools=[WEATHER], tool_choice="required", n=2, max_tokens=20)
        if stream:
            chunks = [chunk async for chunk in await client.chat.completions.create(**request, stream=True)]
            by_choice = {i: [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in (0, 1)}
            got = [("".join(c.delta.content or "" for c in cs), [t for c in cs for t in c.delta.tool_calls or []],
                    cs[-1].finish_reason) for cs in by_choice.values()]
        else:
            whole = await client.chat.completions.create(**request)
            got = [(c.message.content or "", c.message.tool_calls, c.finish_reason) for c in whole.choices]
    assert len(got) == 2
    for content, calls, finish_reason in got:
        assert content == "" and finish_reason == "length"
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Par')]


async def test_an_unknown_field_or_a_tool_message_without_its_call_id_is_a_400_through_the_client(tokenizer):
    async with serve(FakeDispatcher(tokenizer, TEXT), tokenizer) as url, openai_client(url) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER_HI, extra_body={"max_token": 3})
        assert info.value.param == "max_token" and "did you mean 'max_tokens'?" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="x", extra_body={"foo": 1})
        assert info.value.param == "foo"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=[*USER_HI, {"role": "tool", "content": "18C"}])
        assert info.value.param == "messages[1].tool_call_id"


def test_n_is_read_and_bounded(tokenizer):
    assert completion(tokenizer, {"prompt": "x", "n": 4}).n == 4
    for body in ({"prompt": "x", "n": 17}, {"prompt": "x", "n": 0},
                 {"prompt": "x", "n": 2, "echo": True, "max_tokens": 0, "logprobs": 1}):
        with pytest.raises(InvalidParam) as info:
            completion(tokenizer, body)
        assert info.value.param == "n"


# Every field of the official client's request bodies, and where its answer is shown. A field the
# installed openai package knows and this table does not fails the test: classify it (docs/api.md).
HONOURED_FIELDS = {  # each has a test of its effect in this file, test_pipelines, test_structured_output,
    # test_sampling_options, test_logprobs or test_prompt_logprobs
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "echo",
}
ACCEPTED_WITHOUT_EFFECT = {  # they describe the caller or ask about caching, which pdd always does
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_options",
    "prompt_cache_retention",
}


def test_every_field_of_the_openai_clients_request_bodies_is_honoured_refused_or_documented():
    import typing

    from openai.types import completion_create_params as completions_params
    from openai.types.chat import completion_create_params as chat_params

    for params in (chat_params.CompletionCreateParamsBase, completions_params.CompletionCreateParamsBase):
        fields = set(typing.get_type_hints(params))
        unclassified = fields - HONOURED_FIELDS - ACCEPTED_WITHOUT_EFFECT - set(NOT_HONOURED)
        assert not unclassified, f"{params.__module__}: classify {sorted(unclassified)}"
    docs = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    undocumented = {f for f in HONOURED_FIELDS | ACCEPTED_WITHOUT_EFFECT | set(NOT_HONOURED) if f"`{f}`" not in docs}
    assert not undocumented, f"docs/api.md does not answer {sorted(undocumented)}"
