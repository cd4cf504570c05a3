"""What the gateway records about each API request: the trace's root span (`gateway.request`)
and the request metrics (TTFT, gaps between tokens, handoff stall, estimator error).

The middleware opens the root span, so the dispatcher's spans and, through NATS headers, every
service's spans for the request join one trace. Token times are taken where the gateway hands
each token to the HTTP layer; everything is observed once, when the request ends.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.http.http_errors import error_payload
from services.gateway.run.recovery import Action
from shared import tracing
from shared.metrics import GatewayMetrics
from shared.names import HandoffMode, Role

if TYPE_CHECKING:
    from services.gateway.run.request_run import RequestRun

log = logging.getLogger(__name__)

TRACED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"})
STARTED_AT = web.RequestKey("pdd_started_at", float)  # time.monotonic() when the request came in
# A stream that failed after its status line (200) was sent: the status its error maps to, which the
# response metric counts it under (its SSE error event carries the error's code)
STREAM_FAILED_STATUS = web.RequestKey("pdd_stream_failed_status", int)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FinishedGeneration(Protocol):
    """What RequestTelemetry reads of a choice's Generation (services/gateway/http/generation.py)."""

    run: RequestRun
    token_log: list[tuple[float, str]]  # (time.monotonic(), tier) per token handed to the HTTP layer, by index
    tokens_by_tier: dict[str, int]
    finish_reason: str | None
    close_reason: str


def tracing_middleware(metrics: GatewayMetrics) -> Middleware:
    """The root span of an API request; sits inside error_middleware, so it sees the exception
    and works out the status the client will get."""
    tracer = tracing.tracer("pdd.gateway")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else ""
        if route not in TRACED_ROUTES:
            return await handler(request)
        request[STARTED_AT] = time.monotonic()
        with tracer.start_as_current_span("gateway.request", kind=SpanKind.SERVER, record_exception=False,
                                          set_status_on_exception=False, attributes={
                                              "http.request.method": request.method, "http.route": route}) as span:
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                tracing.mark_aborted(span, "client_disconnected")
                metrics.http_responses.labels(route, "499").inc()
                raise
            except Exception as exc:
                status = error_payload(exc)[0]
                span.record_exception(exc)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                metrics.http_responses.labels(route, str(status)).inc()
                raise
            span.set_attribute("http.response.status_code", response.status)
            status = request.get(STREAM_FAILED_STATUS, response.status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            metrics.http_responses.labels(route, str(status)).inc()
            return response

    return middleware


class RequestTelemetry:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self._live: set[FinishedGeneration] = set()
        metrics.track_load(lambda: len(self._live), lambda: sum(1 for g in self._live if not g.token_log))

    def started(self, generation: FinishedGeneration) -> None:
        self._live.add(generation)

    def finished(self, request: web.Request, prompt_tokens: int, generation: FinishedGeneration) -> None:
        """Observe a request that ended; never raises (a metrics bug must not fail a served request)."""
        self._live.discard(generation)
        try:
            self._observe(request, prompt_tokens, generation)
        except Exception:
            log.exception("%s: request telemetry failed", getattr(generation.run, "request_id", "?"))

    def _observe(self, request: web.Request, prompt_tokens: int, generation: FinishedGeneration) -> None:
        run = generation.run
        m = self.metrics
        pipeline = run.pipeline
        times = [t for t, _ in generation.token_log]
        m.requests.labels(pipeline, generation.close_reason).inc()
        m.aborts.labels("finished" if getattr(run, "finished", False) else generation.close_reason).inc()
        for tier, count in generation.tokens_by_tier.items():
            if count:
                m.output_tokens.labels(pipeline, tier).inc(count)
        started = request.get(STARTED_AT, getattr(run, "started_at", times[0] if times else 0.0))
        if times:
            m.ttft.labels(pipeline).observe(times[0] - started)
        if len(times) > 1:
            m.time_per_output_token.labels(pipeline).observe((times[-1] - times[0]) / (len(times) - 1))
            for a, b in zip(times, times[1:]):
                m.inter_token.labels(pipeline).observe(b - a)
        cut = getattr(run, "cut_index", None)  # decided by the run
        cut = cut if cut is not None and 0 < cut < len(times) else None
        stall_s = times[cut] - times[cut - 1] if cut is not None else None
        # a takeover after RLD was lost is a recovery (pdd_recoveries_total), not a planned handoff
        if run.handoff is not None and getattr(run, "recovery", None) is not Action.MAIN_TAKES_OVER:
            mode = run.handoff.mode or HandoffMode.ONE_SHOT
            m.handoffs.labels(mode).inc()
            if stall_s is not None:
                m.handoff_stall.labels(mode).observe(stall_s)
        main_kv = getattr(run, "kv_received", {}).get(Role.MAIN)
        decision = getattr(run, "decision", None)
        if decision is not None and main_kv is not None:
            m.main_ready_error.observe(main_kv.kv_wait_s - decision.predicted_main_ready_s)
        self._annotate(trace.get_current_span(), run, prompt_tokens, generation, started, cut, stall_s)

    @staticmethod
    def _annotate(span: trace.Span, run: RequestRun, prompt_tokens: int, generation: FinishedGeneration,
                  started: float, cut: int | None, stall_s: float | None) -> None:
        times = [t for t, _ in generation.token_log]
        span.set_attributes({
            "pdd.request_id": run.request_id, "pdd.pipeline": run.pipeline, "pdd.prompt_tokens": prompt_tokens,
            "pdd.completion_tokens": len(times), "pdd.close_reason": generation.close_reason,
            **{f"pdd.tokens.{tier}": n for tier, n in generation.tokens_by_tier.items()},
            **({"pdd.finish_reason": generation.finish_reason} if generation.finish_reason else {}),
            **({"pdd.ttft_s": times[0] - started} if times else {})})
        if not times:
            return
        now_ns, now = time.time_ns(), time.monotonic()

        def at_ns(t: float) -> int:
            return now_ns - int((now - t) * 1e9)

        span.add_event("first_token", {"pdd.tier": generation.token_log[0][1]}, timestamp=at_ns(times[0]))
        if cut is not None and stall_s is not None:
            span.add_event("handoff", {"pdd.index": cut, "pdd.stall_s": stall_s}, timestamp=at_ns(times[cut]))
        span.add_event("last_token", {"pdd.index": len(times) - 1}, timestamp=at_ns(times[-1]))
