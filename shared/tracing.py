"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers and KV messages.

With no OTLP endpoint configured, spans are still created (so context flows) but not exported.
"""
from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from shared.names import AbortReason


def setup_tracing(service_name: str, instance_id: str, otlp_endpoint: str,
                  exporter: SpanExporter | None = None) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create(
        {"service.name": service_name, "service.instance.id": instance_id}))
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject() -> dict[str, str]:
    """The current span's context as W3C headers (traceparent, tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(carrier or {}))


def current_trace_id() -> str:
    """The current trace's id as 32 hex digits; empty outside a trace."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def record_error(span: trace.Span, exc: BaseException) -> None:
    """An error that was handled (so no `with` block saw it escape): keep it on the span."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def mark_aborted(span: trace.Span, reason: str) -> None:
    """The gateway's Abort reached this request while it still ran. "finished" and "finished on
    relay" (RLD completed before MD's KV arrived) are the normal end, not an error."""
    span.add_event("abort", {"pdd.reason": reason})
    span.set_attribute("pdd.aborted", reason)
    if reason not in (AbortReason.FINISHED, AbortReason.FINISHED_ON_RELAY):
        span.set_status(Status(StatusCode.ERROR, f"aborted: {reason}"))


def record_span(tracer_: trace.Tracer, name: str, start_ns: int, end_ns: int,
                attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """A span for an interval measured after the fact (a wait in a queue), under the current span."""
    span = tracer_.start_span(name, start_time=start_ns, attributes=dict(attributes or {}))
    span.end(end_time=max(start_ns, end_ns))
