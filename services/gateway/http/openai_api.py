"""The gateway's OpenAI-compatible HTTP API: the routes, and each request taken from its body to
its answer (parse, admit, start its choices, answer whole or streamed).

Owns the handlers only: requests are parsed in request_parsing.py, fanned out to runs in
choices.py, written in answers.py, and errors become responses in http_errors.py.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry import trace

from services.gateway.http.admission import Admission, ClientLeft
from services.gateway.http.answers import json_response, streamed_answer, whole_answer
from services.gateway.http.body_reading import read_body
from services.gateway.http.choices import ChoiceContext, Choices
from services.gateway.http.client_watch import ClientWatch, client_gone
from services.gateway.http.detokenizer import TokenStrings, as_decoder
from services.gateway.http.prompt_echo import PromptOnlyServer
from services.gateway.http.request_parsing import (
    ModelNotFound,
    ParsedRequest,
    check_prompt_bytes,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.http.response_shapes import SYSTEM_FINGERPRINT, Shapes
from services.gateway.http.responses_api import AnswerWriter, ResponsesAPI
from services.gateway.observe.request_telemetry import STARTED_AT, RequestTelemetry
from shared.metrics import GatewayMetrics
from shared.request_ids import new_request_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.gateway.routing.dispatcher import Dispatcher
    from shared.config import GatewayConfig

log = logging.getLogger(__name__)

Json = dict[str, object]

TOKENIZE_NICENESS = 10


def lower_thread_priority() -> None:
    """Run the calling thread at a lower CPU priority (Linux sets niceness per thread; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
    except (AttributeError, OSError) as exc:
        log.debug("tokeniser threads keep their priority: %s", exc)


class OpenAIHandlers:
    """aiohttp handlers for /v1/chat/completions, /v1/completions and /v1/models (and, through
    responses_api.py, /v1/responses)."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: PreTrainedTokenizerBase, served_model: str,
                 config: GatewayConfig, max_context_tokens: int, admission: Admission | None = None,
                 telemetry: RequestTelemetry | None = None) -> None:
        telemetry = telemetry or RequestTelemetry(GatewayMetrics())
        token_strings = TokenStrings(as_decoder(tokenizer))
        self._choice_context = ChoiceContext(dispatcher, tokenizer, token_strings, config, telemetry)
        self._admission = admission or Admission(0, 0, None)
        self._tokenizer = tokenizer
        self._served_model = served_model
        self._config = config
        self._max_context_tokens = max_context_tokens
        self._max_prompt_bytes = max_context_tokens * config.max_prompt_bytes_per_token
        self._prompt_only = PromptOnlyServer(dispatcher, telemetry, token_strings, served_model, SYSTEM_FINGERPRINT)
        # The chat template and the tokeniser run here, not on the event loop: a big prompt would
        # stall every stream (the fast tokeniser releases the GIL while it works). Each thread of the
        # pool tokenises serially and at a lower CPU priority, so a huge prompt cannot take the cores
        # from the model services that share the host with the gateway.
        self._tokenize_pool = ThreadPoolExecutor(max(1, config.tokenizer_threads), thread_name_prefix="tokenize",
                                                 initializer=lower_thread_priority)
        self._created = int(time.time())
        self._responses = ResponsesAPI(self, served_model, config)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
            *self._responses.routes(),
        ]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, "chat", parse_chat_request)
        return await self.serve(request, parsed)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, "completion", parse_completion_request)
        return await self.serve(request, parsed)

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self._served_model:
            raise ModelNotFound("model", f"model {model_id!r} does not exist; this server serves "
                                         f"{self._served_model!r}")
        return json_response(self._model_object())

    def _model_object(self) -> Json:
        return {"id": self._served_model, "object": "model", "created": self._created, "owned_by": "pdd",
                "max_model_len": self._max_context_tokens}

    async def _parse(self, request: web.Request, kind: str,
                     parse: Callable[..., ParsedRequest]) -> ParsedRequest:
        limit = self._config.max_body_bytes
        body = decode_json_body(await read_body(request, self._config.body_timeout_s, limit), limit)
        return await self.parse_body(body, kind, parse)

    async def parse_body(self, body: object, kind: str, parse: Callable[..., ParsedRequest]) -> ParsedRequest:
        """A decoded body parsed, off the event loop (the Responses API's, once made a chat body)."""
        check_prompt_bytes(body, kind, self._max_prompt_bytes)
        job = functools.partial(parse, body, self._tokenizer, self._served_model, self._config,
                                self._max_context_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, job)

    async def serve(self, request: web.Request, parsed: ParsedRequest,
                    answer: AnswerWriter | None = None) -> web.StreamResponse:
        """Admit a parsed request and answer it: as chat or completions do, or with `answer`."""
        deadline_at = request.get(STARTED_AT, time.monotonic()) + self._config.request_timeout_s
        async with self._admission.slot(deadline_at, lambda: client_gone(request)) as queued_s:
            trace.get_current_span().set_attribute("pdd.queued_s", queued_s)
            if parsed.sampling.max_tokens == 0:  # echo of the prompt alone: P scores it, nobody decodes
                return await self._prompt_only.serve(request, parsed, deadline_at)
            return await self._serve_admitted(request, parsed, deadline_at, answer)

    async def _serve_admitted(self, request: web.Request, parsed: ParsedRequest,
                              deadline_at: float, answer: AnswerWriter | None) -> web.StreamResponse:
        request_id = new_request_id()
        shapes = Shapes(response_id=("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + request_id[4:],
                        created=int(time.time()), model=self._served_model, chat=parsed.kind == "chat",
                        include_usage=parsed.include_usage)
        choices = Choices(self._choice_context, parsed, shapes, request_id, deadline_at)
        try:
            await choices.start_first()
            # Before its first token nothing is written that could fail: the watch notices the
            # client gone within a second, and the run's close aborts the request on every tier.
            with ClientWatch(request):
                if answer is not None:
                    return await answer(request, choices)
                if parsed.stream:
                    return await streamed_answer(request, choices)
                return await whole_answer(request, choices)
        except ClientLeft:
            choices.set_close_reason("client_disconnected")
            raise
        except asyncio.CancelledError:
            # aiohttp cancels the handler on disconnect when run with handler_cancellation.
            choices.set_close_reason("client_disconnected" if client_gone(request) else "cancelled")
            raise
        finally:
            await choices.close(request)
