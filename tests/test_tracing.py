"""One OpenTelemetry trace per request across the gateway, P, RLD and MD, with the two datacenters
on one machine: every service exports to the gateway's own OTLP receiver (POST /v1/traces), and
the tests read the trace back from the gateway's store.

The first tests check the receiver and the dashboard's view model on their own (no stack).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator

import aiohttp
import orjson
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.observe.dashboard import timeline
from services.gateway.observe.trace_store import TraceStore, parse_export
from shared.kv_wire import FRAME_HEADER
from tools.api_client import ApiError, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import free_port

CHUNK_TOKENS = 64
STARTUP_TIMEOUT_S = 150.0
TRACE_WAIT_S = 20.0  # spans leave each service in batches every OTEL_BSP_SCHEDULE_DELAY
SERVICES = ("pdd-gateway", "pdd-prefill", "pdd-relay", "pdd-main")
PROMPT = "Once upon a time there was a serving system split across two datacenters. " * 8


def _export_of_two_spans() -> bytes:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "pdd-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer") as outer:
        outer.set_attribute("pdd.request_id", "req-1")
        with tracer.start_as_current_span("inner") as inner:
            inner.add_event("tick", {"n": 1})
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


def test_store_keeps_spans_of_a_protobuf_export_with_parent_links():
    store = TraceStore(max_traces=10)
    store.add(parse_export(_export_of_two_spans(), "application/x-protobuf"))
    (trace_id,) = store.trace_ids()
    outer, inner = store.trace(trace_id)
    assert (outer["name"], inner["name"]) == ("outer", "inner")
    assert inner["parent_span_id"] == outer["span_id"] and outer["parent_span_id"] is None
    assert outer["service"] == "pdd-test" and outer["attributes"] == {"pdd.request_id": "req-1"}
    assert inner["events"][0]["name"] == "tick" and inner["events"][0]["attributes"] == {"n": 1}


def test_store_reads_otlp_json_with_hex_ids():
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "x"}}]},
                               "scopeSpans": [{"spans": [{
                                   "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
                                   "parentSpanId": "eee19b7ec3c1b173", "name": "s", "startTimeUnixNano": "1",
                                   "endTimeUnixNano": "2", "kind": 2,
                                   "attributes": [{"key": "n", "value": {"intValue": "7"}}],
                                   "status": {"code": 2, "message": "boom"}}]}]}]}
    store = TraceStore()
    store.add(parse_export(orjson.dumps(body), "application/json"))
    (span,) = store.trace("5b8efff798038103d269b633813fc60c")
    assert span["span_id"] == "eee19b7ec3c1b174" and span["parent_span_id"] == "eee19b7ec3c1b173"
    assert span["attributes"] == {"n": 7} and span["status"] == {"code": "ERROR", "message": "boom"}
    assert span["kind"] == "server"


def test_store_is_bounded_to_the_most_recent_traces():
    store = TraceStore(max_traces=3)
    for _ in range(5):
        store.add(parse_export(_export_of_two_spans(), "application/x-protobuf"))
    assert len(store) == 3 and len(store.trace_ids()) == 3


def test_timeline_puts_children_after_their_parent_on_one_axis():
    store = TraceStore()
    store.add(parse_export(_export_of_two_spans(), "application/x-protobuf"))
    (trace_id,) = store.trace_ids()
    view = timeline(trace_id, store.trace(trace_id))
    assert [(r["name"], r["depth"]) for r in view["rows"]] == [("outer", 0), ("inner", 1)]
    assert view["rows"][0]["start_ms"] == 0.0 and view["summary"]["request_id"] == "req-1"


# --- one request through the two-datacenter stack ---------------------------------------------


@pytest.fixture(scope="module")
def stack_overrides() -> Iterator[dict[str, object]]:
    port = free_port()  # the gateway is every service's OTLP endpoint, so its port is chosen first
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export every 200 ms instead of every 5 s
        yield {"port": port, "chunk_tokens": CHUNK_TOKENS, "startup_timeout_s": STARTUP_TIMEOUT_S,
               "topology": "two-dc", "wan_bandwidth_mbps": 200.0, "wan_delay_ms": 5.0, "wan_jitter_ms": 0.0,
               "extra_args": {role: ["--otlp-endpoint", endpoint] for role in ("gateway", "prefill", "relay", "main")}}


async def wait_for_trace(session: aiohttp.ClientSession, stack: LocalStack, trace_id: str,
                         ready: Callable[[list[dict]], bool]) -> list[dict]:
    """The stored spans of one trace, once `ready(spans)` holds (services export in batches)."""
    deadline = time.monotonic() + TRACE_WAIT_S
    spans: list[dict] = []
    while time.monotonic() < deadline:
        async with session.get(f"{stack.api_url}/dashboard/api/traces/{trace_id}") as resp:
            if resp.status == 200:
                spans = (await resp.json())["rows"]
                if ready(spans):
                    return spans
        await asyncio.sleep(0.2)
    raise AssertionError(f"trace {trace_id} incomplete after {TRACE_WAIT_S}s: {sorted(s['name'] for s in spans)}")


def by_name(spans: list[dict]) -> dict[str, list[dict]]:
    named: dict[str, list[dict]] = {}
    for span in spans:
        named.setdefault(span["name"], []).append(span)
    return named


def one(spans: list[dict], name: str) -> dict:
    found = by_name(spans).get(name, [])
    assert len(found) == 1, f"{len(found)} spans named {name}"
    return found[0]


EXPECTED = {"gateway.request", "gateway.policy", "gateway.dispatch", "prefill", "prefill.queue", "prefill.chunk",
            "prefill.kv_transfer", "relay.request", "relay.kv_wait", "relay.eager_decode", "relay.handoff_chunk",
            "main.request", "main.kv_wait", "main.handoff", "main.extend_decode", "main.decode"}


async def test_one_trace_joins_gateway_prefill_relay_and_main(stack, session, tiny_tokenizer):
    prompt_ids = tiny_tokenizer(PROMPT)["input_ids"]
    body = {"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 24, "temperature": 0,
            "pdd": {"pipeline": "p-rld-md", "md_kv_delay_ms": 100, "handoff_at": 6}}
    result = await stream_completion(session, stack.api_url, body)
    trace_id = result.summary["trace_id"]
    assert len(trace_id) == 32 and result.tiers == ["relay"] * 6 + ["main"] * 18

    spans = await wait_for_trace(session, stack, trace_id, lambda s: EXPECTED <= {x["name"] for x in s}
                                 and any(x["name"] == "gateway.request" for x in s))
    async with session.get(f"{stack.api_url}/dashboard/api/traces?limit=500") as resp:
        listed = [t for t in (await resp.json())["traces"] if t["trace_id"] == trace_id]
    assert len(listed) == 1 and listed[0]["services"] == ["gateway", "main", "prefill", "relay"]
    request_ids = {s["attributes"]["pdd.request_id"] for s in spans if "pdd.request_id" in s["attributes"]}
    assert len(request_ids) == 1, "every span of the trace belongs to the one request"
    assert {s["service"] for s in spans} == set(SERVICES)

    ids = {s["span_id"]: s for s in spans}
    parent = {s["name"]: ids[s["parent_span_id"]]["name"] if s["parent_span_id"] else None for s in spans}
    assert parent["gateway.request"] is None, "the HTTP request is the root"
    assert parent["gateway.policy"] == parent["gateway.dispatch"] == "gateway.request"
    # across services: the NATS headers of DecodeAssign and PrefillRequest carry the dispatch span
    assert parent["prefill"] == parent["relay.request"] == parent["main.request"] == "gateway.dispatch"
    assert ids[one(spans, "prefill")["parent_span_id"]]["service"] == "pdd-gateway"
    assert all(parent[name] == "prefill" for name in ("prefill.chunk", "prefill.kv_transfer", "prefill.queue"))
    assert parent["relay.kv_wait"] == parent["relay.eager_decode"] == "relay.request"
    assert parent["relay.handoff_chunk"] == "relay.eager_decode"
    assert parent["main.kv_wait"] == parent["main.handoff"] == parent["main.decode"] == "main.request"
    assert parent["main.extend_decode"] == "main.decode"

    root = one(spans, "gateway.request")["attributes"]
    assert root["http.route"] == "/v1/completions" and root["http.response.status_code"] == 200
    assert root["pdd.pipeline"] == "p-rld-md" and root["pdd.completion_tokens"] == 24
    assert (root["pdd.tokens.relay"], root["pdd.tokens.main"]) == (6, 18)
    assert {e["name"] for e in one(spans, "gateway.request")["events"]} >= {"first_token", "handoff", "last_token"}
    policy = one(spans, "gateway.policy")["attributes"]
    assert policy["pdd.pipeline"] == "p-rld-md" and "pdd.main_ready_predicted_s" in policy

    kv_tokens = len(prompt_ids) - 1
    chunks = sorted((c["attributes"]["pdd.token_start"], c["attributes"]["pdd.token_end"])
                    for c in by_name(spans)["prefill.chunk"])
    assert len(chunks) == math.ceil(kv_tokens / CHUNK_TOKENS) and chunks[0][0] == 0 and chunks[-1][1] == kv_tokens
    transfers = {t["attributes"]["pdd.target_role"]: t["attributes"] for t in by_name(spans)["prefill.kv_transfer"]}
    assert set(transfers) == {"relay", "main"}
    for role, attrs in transfers.items():
        payload = result.summary["kv"][role]["kv_bytes"]
        overhead = attrs["pdd.kv_bytes"] - payload  # P counts each frame's header too
        assert attrs["pdd.outcome"] == "done" and overhead > 0 and overhead % FRAME_HEADER.size == 0
        assert attrs["pdd.throughput_bytes_per_s"] > 0 and attrs["pdd.connections"] >= 1
        assert one(spans, f"{role}.kv_wait")["attributes"]["pdd.kv_bytes"] == payload
    assert transfers["main"]["pdd.delay_s"] == pytest.approx(0.1)

    assert one(spans, "relay.eager_decode")["attributes"]["pdd.eager_tokens"] == 6
    cut = [c["attributes"] for c in by_name(spans)["relay.handoff_chunk"] if c["attributes"]["pdd.final"]]
    assert len(cut) == 1 and cut[0]["pdd.end"] == 6
    assert one(spans, "main.handoff")["attributes"]["pdd.eager_tokens"] == 6
    assert one(spans, "main.decode")["attributes"]["pdd.tokens"] == 18
    assert all(s["status"]["code"] != "ERROR" for s in spans)


async def test_an_abort_is_marked_on_the_spans_it_reached(stack, session, tiny_tokenizer):
    # RLD finishes 2 tokens long before MD's KV (delayed 3 s) is in: the gateway's Abort finds P
    # still sending to MD, and the trace says so
    prompt_ids = tiny_tokenizer("[abort] " + PROMPT)["input_ids"]
    body = {"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 2, "temperature": 0,
            "pdd": {"pipeline": "p-rld-md", "md_kv_delay_ms": 3000}}
    result = await stream_completion(session, stack.api_url, body)
    assert result.tiers == ["relay", "relay"]
    spans = await wait_for_trace(session, stack, result.summary["trace_id"], lambda s: any(
        x["name"] == "prefill.kv_transfer" and x["attributes"].get("pdd.target_role") == "main" for x in s))
    to_main = next(s for s in spans if s["name"] == "prefill.kv_transfer"
                   and s["attributes"]["pdd.target_role"] == "main")
    assert to_main["attributes"]["pdd.outcome"] == "aborted"
    # MD made no token: the Abort says so, and P counts what its MD path sent for nothing
    assert to_main["attributes"]["pdd.aborted"] == "finished on relay" and to_main["status"]["code"] != "ERROR"
    prefill = one(spans, "prefill")
    assert any(e["name"] == "abort" and e["attributes"]["pdd.reason"] == "finished on relay"
               for e in prefill["events"])


async def test_a_refused_request_is_a_root_span_with_its_error(stack, session):
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": -1}
    with pytest.raises(ApiError) as refused:
        await stream_completion(session, stack.api_url, body)
    assert refused.value.status == 400
    deadline = time.monotonic() + TRACE_WAIT_S
    while time.monotonic() < deadline:
        async with session.get(f"{stack.api_url}/dashboard/api/traces?all=1&limit=500") as resp:
            traces = (await resp.json())["traces"]
        failed = [t for t in traces if t["root"] == "gateway.request" and t["http_status"] == 400]
        if failed:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("no trace of the refused request")
    async with session.get(f"{stack.api_url}/dashboard/api/traces/{failed[0]['trace_id']}") as resp:
        (root,) = (await resp.json())["rows"]
    assert root["name"] == "gateway.request" and root["attributes"]["http.response.status_code"] == 400
    assert [e["name"] for e in root["events"]] == ["exception"]
