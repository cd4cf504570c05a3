"""Parsing and validating OpenAI API request bodies: pure functions, every failure a BadRequest.

Owns what a valid request is (fields, ranges, context length, the `pdd` extension); knows
nothing of HTTP or of how the request is served.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jinja2
import orjson

from services.gateway.http.detokenizer import as_decoder
from services.gateway.http.tool_calls import (
    ToolRequest,
    parse_tool_request,
    render_chat,
    template_takes_tools,
)
from shared.config import GatewayConfig
from shared.errors import BadRequest, InvalidParam
from shared.grammar import AnswerFormat, Constraint, answer_format
from shared.names import FailurePolicy, HandoffMode, Pipeline, choices
from shared.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_STOP_STRINGS = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # ints travel to the workers as JSON, which orjson caps at 64 bits
PDD_EXTENSION_FIELDS = ("pipeline", "handoff_at", "md_kv_delay_ms", "handoff_mode", "failure_policy")
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_CHOICES = 16  # n: each choice is a request of its own on the decoders
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs`: OpenAI's limit (chat's top_logprobs goes to 20)
# Fields of OpenAI's (and vLLM's) request bodies that pdd does not honour yet, each with the values
# that ask for nothing (None, or the field's default). Any other value is refused with a 400 naming
# the field: a client must never get prose where it asked for a tool call, JSON or logprobs.
NOT_HONOURED: dict[str, tuple[object, ...]] = {
    "functions": ([],), "function_call": ("none",),
    "suffix": ("",), "best_of": (1,), "prompt_logprobs": (0,), "prediction": (),
    "audio": (), "modalities": (["text"],), "moderation": (), "web_search_options": (), "reasoning_effort": (),
    "verbosity": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
}
# Every field a request may have; any other is refused naming it, so a typo ("max_token") is told, never
# served as if it were absent. Chat: every field of the official openai client's chat completions
# (openai 3.3's completion_create_params, tested against the installed package); completions: its
# completions fields. Both: vLLM's sampling extras, NOT_HONOURED, and pdd's own `pdd`.
OPENAI_CHAT_FIELDS = (
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
)
OPENAI_COMPLETION_FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
)
VLLM_FIELDS = ("top_k", "ignore_eos", "stop_token_ids", "min_tokens", "include_stop_str_in_output",
               "repetition_penalty", "min_p")
KNOWN_FIELDS = {
    # echo on chat and top_logprobs on completions are known so that their own clear refusal answers them
    "chat": frozenset((*OPENAI_CHAT_FIELDS, *VLLM_FIELDS, *NOT_HONOURED, "pdd", "echo")),
    "completion": frozenset((*OPENAI_COMPLETION_FIELDS, *VLLM_FIELDS, *NOT_HONOURED, "pdd", "response_format",
                             "top_logprobs")),
}


class NotFound(InvalidParam):
    """What the request names does not exist here: HTTP 404."""


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(BadRequest):
    code = "payload_too_large"


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    include_stop: bool  # include_stop_str_in_output: the text ends with the stop string that ended it
    stream: bool
    include_usage: bool
    pipeline: Pipeline | None
    handoff_at: int | None
    md_kv_delay_s: float
    echo: str | None = None  # completions: the prompt's text, which the answer starts with (None: no echo)
    handoff_mode: HandoffMode | None = None
    failure_policy: FailurePolicy | None = None
    tools: ToolRequest | None = None  # chat: the tools offered and tool_choice; the answer may hold calls
    n: int = 1  # choices: choice i samples with choice_seed(seed, i)
    max_tokens_param: str | None = None  # the field the client limited the answer with; None: the default

    @property
    def prompt_logprobs(self) -> int | None:
        """Echo with logprobs N: P scores the prompt, with the N likeliest tokens at each position."""
        return self.sampling.logprobs if self.echo is not None else None

    @property
    def reads_tool_calls(self) -> bool:
        """The answer's text is read for tool calls (tools offered and tool_choice not "none")."""
        return self.tools is not None and bool(self.tools.names)


def decode_json_body(raw: bytes, max_body_bytes: int) -> object:
    if len(raw) > max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {max_body_bytes}")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 JSON: {_json_fault(raw, exc)}") from None


def _json_fault(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Where the body stops being UTF-8 JSON, in words (orjson's own words for bad UTF-8 speak of
    surrogates and str, which the client never sent)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"byte {bad.start} (0x{raw[bad.start]:02x}) is not UTF-8"
    if "depth limit" in exc.msg:
        return "it nests arrays and objects deeper than 1024 levels"
    if not raw.strip():
        return "the body is empty"
    return f"{exc.msg} at line {exc.lineno} column {exc.colno}"


def check_prompt_bytes(body: object, kind: str, max_bytes: int) -> None:
    """Refuse a prompt too big for any tokenisation to fit the context, before tokenising it (cheap,
    so it runs on the event loop; the tokeniser does not). Shapes are checked later, by the parser."""
    if not isinstance(body, dict):
        return
    param = "messages" if kind == "chat" else "prompt"
    prompt = body.get(param)
    if kind == "chat" and isinstance(prompt, list):
        texts = [m.get("content") for m in prompt if isinstance(m, dict)]
        texts += [p.get("text") for c in texts if isinstance(c, list) for p in c if isinstance(p, dict)]
    else:
        texts = prompt if isinstance(prompt, list) else [prompt]
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
    if size > max_bytes:
        raise InvalidParam(param, f"the prompt is {size} bytes, more than this model's context could hold as "
                                  f"tokens (at most {max_bytes} bytes)")


def parse_chat_request(body: object, tokenizer: PreTrainedTokenizerBase, served_model: str,
                       config: GatewayConfig, max_context_tokens: int) -> ParsedRequest:
    fields = _request_object(body, served_model, "chat")
    answer, from_format = _response_format(fields)
    tools = parse_tool_request(fields.get("tools"), fields.get("tool_choice"),
                               parallel=_bool(fields, "parallel_tool_calls", default=True), answer=answer)
    prompt_ids = _chat_prompt_ids(fields.get("messages"), tools, tokenizer)
    # the tools' grammar when they have one (forced calls, or calls or the answer), else response_format's
    constraint = tools.constraint if tools is not None and tools.constraint is not None else from_format
    return _parse_generation(fields, "chat", prompt_ids, tokenizer, config, max_context_tokens, constraint, tools)


def parse_completion_request(body: object, tokenizer: PreTrainedTokenizerBase, served_model: str,
                             config: GatewayConfig, max_context_tokens: int) -> ParsedRequest:
    fields = _request_object(body, served_model, "completion")
    constraint = _response_format(fields)[1]
    prompt_ids = _completion_prompt_ids(fields.get("prompt"), tokenizer)
    parsed = _parse_generation(fields, "completion", prompt_ids, tokenizer, config, max_context_tokens, constraint)
    if not _bool(fields, "echo"):
        return parsed
    prompt = fields["prompt"][0] if isinstance(fields["prompt"], list) and len(fields["prompt"]) == 1 \
        and isinstance(fields["prompt"][0], (str, list)) else fields["prompt"]
    text = prompt if isinstance(prompt, str) else as_decoder(tokenizer).decode(prompt_ids)  # as vLLM echoes ids
    return dataclasses.replace(parsed, echo=text)


def _request_object(body: object, served_model: str, kind: str) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    refuse_unknown_fields(body, KNOWN_FIELDS[kind], "chat completions" if kind == "chat" else "completions")
    model = body.get("model")
    # Lenient where OpenAI is strict: a missing model means the one we serve.
    if model is not None and model != served_model:
        raise ModelNotFound("model", f"model {model!r} does not exist; this server serves {served_model!r}")
    for name, neutral in NOT_HONOURED.items():
        if not _asks_nothing(body.get(name), neutral):
            raise InvalidParam(name, f"{name} is not supported by this server yet; leave it out (or at "
                                     f"{_spelled(neutral)})")
    return body


def refuse_unknown_fields(body: Mapping[str, object], known: frozenset[str], api: str) -> None:
    """A 400 naming the first field not in `known`, and the known field each unknown one may be a typo of."""
    unknown = sorted(name for name in body if name not in known)
    if not unknown:
        return
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
             for name in unknown for close in [difflib.get_close_matches(name, known, n=1, cutoff=0.8)]]
    raise InvalidParam(unknown[0], f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: {api} "
                                   "take OpenAI's fields, vLLM's sampling extras and `pdd` (docs/api.md)")


def _asks_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    """None, or one of the neutral values (numbers by value, never a bool for a number)."""
    if value is None:
        return True
    for n in neutral:
        if isinstance(n, bool) or isinstance(value, bool):
            if value is n:
                return True
        elif isinstance(n, (int, float)) and isinstance(value, (int, float)):
            if value == n:
                return True
        elif type(value) is type(n) and value == n:
            return True
    return False


def _spelled(neutral: tuple[object, ...]) -> str:
    return " or ".join(["null", *(orjson.dumps(n).decode() for n in neutral)])


def _chat_prompt_ids(messages: object, tools: ToolRequest | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content} objects")
    prompt = render_chat(messages, tools, native=template_takes_tools(tokenizer), text_message=_chat_message)
    try:
        # transformers types messages as dicts of strings and tools as plain dicts; templates take
        # the tool_calls lists and JSON schemas that render_chat puts in them
        encoded = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools,  # type: ignore[arg-type]
                                                add_generation_prompt=True, tokenize=True)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidParam("messages", f"the model's chat template cannot render these messages: {exc}") from None
    return _input_ids(encoded)


def _chat_message(message: object, i: int) -> dict[str, str]:
    if not isinstance(message, dict):
        raise InvalidParam(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidParam(f"messages[{i}].role", f"messages[{i}].role must be a non-empty string")
    if role == "function":
        raise InvalidParam(f"messages[{i}].role", f"messages[{i}]: function messages belong to the deprecated "
                                                  "function calling; send tool messages instead")
    if role not in CHAT_ROLES:
        raise InvalidParam(f"messages[{i}].role", f"messages[{i}].role must be one of {[*CHAT_ROLES, 'tool']}")
    content = message.get("content")
    if content is None and role == "assistant":  # an empty assistant turn
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        strings = [text for text in texts if isinstance(text, str)]
        if len(strings) == len(content):
            return {"role": role, "content": "\n".join(strings)}  # vLLM joins text parts the same way
    raise InvalidParam(f"messages[{i}].content",
                       f"messages[{i}].content must be a string or a list of {{type: 'text', text}} parts")


def _input_ids(encoded: object) -> list[int]:
    """apply_chat_template returns a list in transformers 4 and a BatchEncoding in 5."""
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]  # type: ignore[union-attr]


def _completion_prompt_ids(prompt: object, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParam("prompt", "the prompt is empty")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab_size = len(tokenizer)
        if any(not 0 <= t < vocab_size for t in prompt):
            raise InvalidParam("prompt", f"prompt token ids must be in [0, {vocab_size})")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidParam("prompt", "only one prompt per request is supported")
    raise InvalidParam("prompt", "prompt must be a string or a list of token ids")


def _parse_generation(fields: Mapping[str, object], kind: str, prompt_ids: list[int],
                      tokenizer: PreTrainedTokenizerBase, config: GatewayConfig, max_context_tokens: int,
                      constraint: Constraint | None, tools: ToolRequest | None = None) -> ParsedRequest:
    prompt_param = "messages" if kind == "chat" else "prompt"
    if not prompt_ids:
        raise InvalidParam(prompt_param, "the prompt is empty")
    if len(prompt_ids) > max_context_tokens - 1:
        raise InvalidParam(prompt_param, f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                                         f"{max_context_tokens} tokens, so a prompt may have at most "
                                         f"{max_context_tokens - 1}")
    n = _int(fields, "n", minimum=1) or 1
    if n > MAX_CHOICES:
        raise InvalidParam("n", f"n must be from 1 to {MAX_CHOICES}")
    stream = _bool(fields, "stream")
    stream_options = _object(fields, "stream_options")
    # include_obfuscation pads chunks against length side channels; pdd never pads, so it asks for nothing
    unknown = sorted(set(stream_options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise InvalidParam(f"stream_options.{unknown[0]}", f"stream_options has unknown fields {unknown}; it takes "
                                                           "include_usage (and include_obfuscation, without effect)")
    _bool(stream_options, "include_obfuscation", "stream_options.")
    pipeline, handoff_at, md_kv_delay_s, handoff_mode, failure_policy = _pdd_extension(_object(fields, "pdd"))
    seed = _int(fields, "seed", minimum=INT64_MIN)
    top_k = _int(fields, "top_k", minimum=-1)
    temperature = _number(fields, "temperature")
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidParam("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
    top_p = _number(fields, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidParam("top_p", "top_p must be greater than 0 and at most 1")
    if kind == "chat" and _bool(fields, "echo"):
        raise InvalidParam("echo", "echo is a completions field; chat completions do not take it")
    max_tokens = _max_tokens(fields, len(prompt_ids), config, max_context_tokens, zero_allowed=_bool(fields, "echo"))
    if max_tokens == 0 and n > 1:
        raise InvalidParam("n", "n > 1 needs max_tokens of at least 1: with max_tokens 0 every choice is the prompt")
    min_tokens = _int(fields, "min_tokens", minimum=0) or 0
    if min_tokens > max_tokens:
        raise InvalidParam("min_tokens", f"min_tokens={min_tokens} is more than max_tokens={max_tokens}")
    ignore_eos = _bool(fields, "ignore_eos")
    if constraint is not None and (min_tokens or ignore_eos):
        # a finished grammar allows only EOS: holding it back would leave no token to pick
        name = "min_tokens" if min_tokens else "ignore_eos"
        raise InvalidParam(name, f"{name} cannot be combined with response_format or a forced tool call: the "
                                 "answer ends when its grammar is complete")
    repetition_penalty = _number(fields, "repetition_penalty")
    if repetition_penalty is not None and repetition_penalty <= 0.0:
        raise InvalidParam("repetition_penalty", "repetition_penalty must be greater than 0")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,  # vLLM spells "off" as -1, we as 0
        # A drawn seed rather than none: the tiers then sample the same token at each index.
        seed=secrets.randbits(63) if seed is None else seed,
        eos_token_ids=() if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),),
        stop_token_ids=_stop_token_ids(fields.get("stop_token_ids"), len(tokenizer)),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        presence_penalty=_ranged(fields, "presence_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0,
        frequency_penalty=_ranged(fields, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        logit_bias=_logit_bias(fields.get("logit_bias"), len(tokenizer)),
        min_p=_ranged(fields, "min_p", 0.0, 1.0) or 0.0,
        logprobs=_chat_logprobs(fields) if kind == "chat" else _completion_logprobs(fields),
        constraint=None if constraint is None else constraint.to_dict(),
    )
    return ParsedRequest(
        kind=kind, prompt_ids=tuple(prompt_ids), sampling=sampling, stop=_stop_strings(fields.get("stop")),
        include_stop=_bool(fields, "include_stop_str_in_output"),
        stream=stream, include_usage=stream and _bool(stream_options, "include_usage", "stream_options."),
        pipeline=pipeline, handoff_at=handoff_at, md_kv_delay_s=md_kv_delay_s, handoff_mode=handoff_mode,
        failure_policy=failure_policy, tools=tools, n=n,
        max_tokens_param=next((name for name in ("max_completion_tokens", "max_tokens")
                               if fields.get(name) is not None), None),
    )


def _response_format(fields: Mapping[str, object]) -> tuple[AnswerFormat | None, Constraint | None]:
    """response_format, checked, and its grammar, compiled on its own so that a bad schema is refused
    naming it even where another grammar serves (tools beside it)."""
    response_format = fields.get("response_format")
    answer = None if response_format is None else answer_format(response_format)
    return answer, None if answer is None else answer.constraint()


def _max_tokens(fields: Mapping[str, object], prompt_tokens: int, config: GatewayConfig,
                max_context_tokens: int, zero_allowed: bool = False) -> int:
    """`zero_allowed` (completions with echo): 0 asks for the prompt alone, no output token."""
    name = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    requested = _int(fields, name, minimum=0)
    if requested == 0 and not zero_allowed:
        raise InvalidParam(name, f"{name} must be at least 1 (0 only with echo: true, on completions: the "
                                 "prompt and its logprobs alone)")
    room = max_context_tokens - prompt_tokens
    if requested is None:
        return max(1, room if config.default_max_tokens == 0 else min(config.default_max_tokens, room))
    if requested > room:  # like vLLM: an explicit limit that cannot fit is the client's error
        raise InvalidParam(name, f"{name}={requested} plus the prompt's {prompt_tokens} tokens exceeds this "
                                 f"model's context of {max_context_tokens} tokens")
    return requested


def _stop_token_ids(ids: object, vocab_size: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                            for t in ids):
        raise InvalidParam("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {vocab_size})")
    return tuple(dict.fromkeys(ids))


def _logit_bias(bias: object, vocab_size: int) -> dict[int, float]:
    if bias is None:
        return {}
    message = (f"logit_bias must map token ids in [0, {vocab_size}) to numbers from -{MAX_LOGIT_BIAS:g} to "
               f"{MAX_LOGIT_BIAS:g}")
    if not isinstance(bias, dict):
        raise InvalidParam("logit_bias", message)
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if (not 0 <= token < vocab_size or isinstance(value, bool) or not isinstance(value, (int, float))
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidParam("logit_bias", f"{message}; got {key!r}: {value!r}")
        parsed[token] = float(value)
    return parsed


def _chat_logprobs(fields: Mapping[str, object]) -> int | None:
    """None (off), or how many of the likeliest tokens to show beside each chosen one."""
    top = _small_int(fields, "top_logprobs", MAX_LOGPROBS)
    if not _bool(fields, "logprobs"):
        if top:
            raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _completion_logprobs(fields: Mapping[str, object]) -> int | None:
    if fields.get("top_logprobs") not in (None, 0):
        raise InvalidParam("top_logprobs", f"completions take logprobs: N (0 to {MAX_COMPLETION_LOGPROBS}) "
                                           "instead of top_logprobs")
    return _small_int(fields, "logprobs", MAX_COMPLETION_LOGPROBS)


def _small_int(fields: Mapping[str, object], name: str, most: int) -> int | None:
    value = fields.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most):
        raise InvalidParam(name, f"{name} must be null or an integer from 0 to {most}")
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise InvalidParam("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return tuple(stops)


def _pdd_extension(ext: Mapping[str, object]) -> tuple[Pipeline | None, int | None, float, HandoffMode | None,
                                                        FailurePolicy | None]:
    unknown = sorted(set(ext) - set(PDD_EXTENSION_FIELDS))
    if unknown:  # our own knobs: a typo should fail loudly, not run the default silently
        raise InvalidParam("pdd", f"unknown pdd fields {unknown}; known: {list(PDD_EXTENSION_FIELDS)}")
    pipeline = _one_of(ext, "pipeline", choices(Pipeline.requestable()))
    delay_ms = _number(ext, "md_kv_delay_ms", "pdd.")
    if delay_ms is not None and delay_ms < 0:
        raise InvalidParam("pdd.md_kv_delay_ms", "pdd.md_kv_delay_ms must be >= 0")
    handoff_at = _int(ext, "handoff_at", minimum=0, prefix="pdd.")
    handoff_mode = _one_of(ext, "handoff_mode", choices(HandoffMode))
    failure_policy = _one_of(ext, "failure_policy", choices(FailurePolicy))
    return (None if pipeline is None else Pipeline(pipeline), handoff_at, (delay_ms or 0.0) / 1000.0,
            None if handoff_mode is None else HandoffMode(handoff_mode),
            None if failure_policy is None else FailurePolicy(failure_policy))


def _one_of(ext: Mapping[str, object], name: str, allowed: tuple[str, ...]) -> str | None:
    value = ext.get(name)
    if value is not None and (not isinstance(value, str) or value not in allowed):
        raise InvalidParam(f"pdd.{name}", f"pdd.{name} must be one of {list(allowed)}")
    return value


def _object(fields: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = fields.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParam(name, f"{name} must be an object")
    return value


def _int(fields: Mapping[str, object], name: str, *, minimum: int, prefix: str = "") -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT64_MAX:
        raise InvalidParam(prefix + name, f"{prefix}{name} must be an integer from {minimum} to {INT64_MAX}")
    return value


def _number(fields: Mapping[str, object], name: str, prefix: str = "") -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise InvalidParam(prefix + name, f"{prefix}{name} must be a finite number")


def _ranged(fields: Mapping[str, object], name: str, low: float, high: float) -> float | None:
    try:
        number = _number(fields, name)
    except InvalidParam:
        number = math.nan
    if number is not None and not low <= number <= high:
        raise InvalidParam(name, f"{name} must be a number from {low:g} to {high:g}")
    return number


def _bool(fields: Mapping[str, object], name: str, prefix: str = "", default: bool = False) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParam(prefix + name, f"{prefix}{name} must be true or false")
    return value


