"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers and KV messages.

With no OTLP endpoint configured, spans are still created (so context flows) but not exported.
"""
from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


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
