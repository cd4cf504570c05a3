"""The gateway's own OTLP/HTTP trace receiver: `POST /v1/traces` into a bounded in-memory store.

Every service may export its spans here (`--otlp-endpoint http://<gateway>/v1/traces`), so the
dashboard needs no Jaeger. Accepts protobuf (`ExportTraceServiceRequest`, optionally gzipped) and
OTLP/JSON; keeps the most recently updated traces; optionally forwards each batch unchanged.
"""
from __future__ import annotations

import asyncio
import base64
import gzip
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from services.gateway.http.body_reading import read_body

log = logging.getLogger(__name__)

Json = dict[str, object]
PROTOBUF = "application/x-protobuf"
MAX_FORWARDS_IN_FLIGHT = 8
FORWARD_TIMEOUT_S = 5.0
_SPAN_KINDS = {v: k.removeprefix("SPAN_KIND_").lower() for k, v in Span.SpanKind.items()}
_STATUS_CODES = {v: k.removeprefix("STATUS_CODE_") for k, v in Status.StatusCode.items()}
_HEX_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class BadTraceExport(ValueError):
    """The body is not an OTLP trace export."""


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def _attributes(pairs: Iterable[KeyValue]) -> Json:
    return {kv.key: _value(kv.value) for kv in pairs}


def span_json(span: Span, resource: Json) -> Json:
    """One span as the dashboard reads it: hex ids, times in ns since the epoch, plain attributes."""
    return {
        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None, "name": span.name,
        "kind": _SPAN_KINDS.get(span.kind, "unspecified"),
        "service": resource.get("service.name", "unknown"), "instance": resource.get("service.instance.id"),
        "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
        "attributes": _attributes(span.attributes),
        "events": [{"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attributes(e.attributes)}
                   for e in span.events],
        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                   "attributes": _attributes(link.attributes)} for link in span.links],
        "status": {"code": _STATUS_CODES.get(span.status.code, "UNSET"), "message": span.status.message},
    }


def _hex_ids_to_base64(node: object) -> None:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping wants base64 for bytes."""
    if isinstance(node, dict):
        for key, item in node.items():
            if key in _HEX_ID_FIELDS and isinstance(item, str) and item:
                node[key] = base64.b64encode(bytes.fromhex(item)).decode()
            else:
                _hex_ids_to_base64(item)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)


def parse_export(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        if content_type == "application/json":
            doc = orjson.loads(body)
            _hex_ids_to_base64(doc)
            json_format.ParseDict(doc, request, ignore_unknown_fields=True)
        else:
            request.ParseFromString(body)
    except (DecodeError, json_format.ParseError, orjson.JSONDecodeError, ValueError) as exc:
        raise BadTraceExport(f"not an OTLP trace export ({content_type}): {exc}") from exc
    return request


@dataclass
class _Trace:
    spans: dict[str, Json] = field(default_factory=dict)  # span_id -> span


class TraceStore:
    """The most recently updated `max_traces` traces, each at most `max_spans_per_trace` spans."""

    def __init__(self, max_traces: int = 500, max_spans_per_trace: int = 5000) -> None:
        self.max_traces = max(1, max_traces)
        self.max_spans_per_trace = max_spans_per_trace
        self._traces: OrderedDict[str, _Trace] = OrderedDict()
        self.spans_received = 0
        self.spans_dropped = 0

    def add(self, export: ExportTraceServiceRequest) -> int:
        added = 0
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    added += self._add_span(span_json(span, resource))
        return added

    def _add_span(self, span: Json) -> int:
        self.spans_received += 1
        trace_id = str(span["trace_id"])
        trace = self._traces.get(trace_id)
        if trace is None:
            trace = self._traces[trace_id] = _Trace()
        else:
            self._traces.move_to_end(trace_id)
        if len(trace.spans) >= self.max_spans_per_trace and span["span_id"] not in trace.spans:
            self.spans_dropped += 1
            return 0
        trace.spans[str(span["span_id"])] = span
        while len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)
        return 1

    def trace(self, trace_id: str) -> list[Json] | None:
        trace = self._traces.get(trace_id.lower())
        if trace is None:
            return None
        return sorted(trace.spans.values(), key=lambda s: (s["start_ns"], s["end_ns"]))

    def trace_ids(self) -> list[str]:
        """Most recently updated first."""
        return list(reversed(self._traces))

    def __len__(self) -> int:
        return len(self._traces)


class OtlpReceiver:
    """aiohttp shell around a TraceStore: the OTLP/HTTP endpoint and the optional forwarding."""

    def __init__(self, store: TraceStore, forward_endpoint: str = "", body_timeout_s: float = 10.0) -> None:
        self.store = store
        self.forward_endpoint = forward_endpoint
        self.body_timeout_s = body_timeout_s
        self.forwards_dropped = 0
        self._forwards: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/traces", self.export)]

    async def export(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.body_timeout_s)
        content_type = request.content_type or PROTOBUF
        try:
            raw = gzip.decompress(body) if request.headers.get("Content-Encoding", "") == "gzip" else body
            export = parse_export(raw, content_type)
        except (BadTraceExport, OSError, EOFError) as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        self.store.add(export)
        if self.forward_endpoint:
            self._forward(body, request.headers)
        if content_type == "application/json":
            return web.json_response({})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)

    def _forward(self, body: bytes, headers: Mapping[str, str]) -> None:
        if len(self._forwards) >= MAX_FORWARDS_IN_FLIGHT:
            self.forwards_dropped += 1  # the collector is slow or gone: tracing must not hold the gateway
            return
        forward_headers = {k: v for k, v in headers.items() if k in ("Content-Type", "Content-Encoding")}
        task = asyncio.create_task(self._post(body, forward_headers))
        self._forwards.add(task)
        task.add_done_callback(self._forwards.discard)

    async def _post(self, body: bytes, headers: dict[str, str]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S))
        try:
            async with self._session.post(self.forward_endpoint, data=body, headers=headers) as resp:
                if resp.status >= 300:
                    log.warning("trace forward to %s: HTTP %d", self.forward_endpoint, resp.status)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.forwards_dropped += 1
            log.debug("trace forward to %s failed: %s", self.forward_endpoint, exc)

    async def close(self) -> None:
        for task in self._forwards:
            task.cancel()
        await asyncio.gather(*self._forwards, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
