"""The PDD timeline page: recent requests from the trace store, and one request's stages as a
waterfall on one time axis (P's prefill, the KV paths, RLD's eager tokens, the handoff, MD).

Plain HTML and JavaScript (static/dashboard.html) over two JSON routes; the view model is built
here from the stored spans, so the page only draws.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from aiohttp import web

from services.gateway.observe.trace_store import TraceStore

Json = dict[str, object]
SpanJson = dict  # one span as trace_store.span_json builds it
PAGE = Path(__file__).parent / "static" / "dashboard.html"
ROOT_SPAN = "gateway.request"
TIER_ORDER = {"gateway": 0, "prefill": 1, "relay": 2, "main": 3}  # the request's path, top to bottom
DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 500


def _tier(span: SpanJson) -> str:
    return str(span.get("service", "")).removeprefix("pdd-")


def _mb(n: object) -> str:
    return f"{float(n) / 1e6:.2f} MB" if isinstance(n, (int, float)) else "?"


def detail(span: SpanJson) -> str:
    """The one line a waterfall row shows beside its bar."""
    a = span["attributes"]
    name = span["name"]
    if name == ROOT_SPAN:
        tokens = f"{a.get('pdd.completion_tokens', '?')} tokens"
        return (f"{a.get('http.route', '')} {a.get('pdd.pipeline', '')} · {tokens} "
                f"· HTTP {a.get('http.response.status_code', '?')}")
    if name == "gateway.policy":
        return (f"{a.get('pdd.pipeline')}: {a.get('pdd.policy_reason')} "
                f"(MD ready in {float(a.get('pdd.main_ready_predicted_s', 0)) * 1e3:.0f} ms predicted)")
    if name == "prefill":
        return f"{a.get('pdd.prompt_tokens')} prompt tokens, {a.get('pdd.cached_tokens')} cached"
    if name in ("prefill.chunk", "prefill.queue"):
        if "pdd.token_start" in a:
            return f"tokens [{a.get('pdd.token_start')}, {a.get('pdd.token_end')})"
        return ""
    if name == "prefill.kv_transfer":
        rate = a.get("pdd.throughput_bytes_per_s")
        rate_text = f", {float(rate) / 1e6:.1f} MB/s" if isinstance(rate, (int, float)) and rate else ""
        return f"→ {a.get('pdd.target_role')}: {_mb(a.get('pdd.kv_bytes'))}{rate_text}, {a.get('pdd.outcome', '?')}"
    if name.endswith(".kv_wait"):
        return f"{_mb(a.get('pdd.kv_bytes'))} received"
    if name == "relay.eager_decode":
        return f"{a.get('pdd.eager_tokens')} eager tokens ({a.get('pdd.handoff_mode')})"
    if name in ("relay.handoff_chunk", "main.catch_up_chunk"):
        start = a.get("pdd.start")
        end = a.get("pdd.end", (start or 0) + (a.get("pdd.tokens") or 0))
        return f"tokens [{start}, {end})" + (" final" if a.get("pdd.final") else "")
    if name == "main.handoff":
        return f"{a.get('pdd.eager_tokens', '?')} eager tokens adopted ({a.get('pdd.handoff_mode', '?')})"
    if name == "main.extend_decode":
        return f"{a.get('pdd.extend_tokens')} tokens in one pass"
    if name == "main.decode":
        return f"{a.get('pdd.tokens')} tokens"
    if name == "gateway.dispatch":
        return f"{a.get('pdd.pipeline')}"
    if name in ("relay.request", "main.request"):
        cached = a.get("pdd.cached_tokens") or 0
        plural = "s" if cached != 1 else ""
        return f"{span.get('instance') or ''}" + (f", {cached} prompt token{plural} from the DRC" if cached else "")
    return ""


def _root(spans: list[SpanJson]) -> SpanJson | None:
    roots = [s for s in spans if s["name"] == ROOT_SPAN] or [s for s in spans if not s["parent_span_id"]]
    return roots[0] if roots else None


def tier_tokens(spans: list[SpanJson]) -> dict[str, int]:
    """Output tokens each decoder made: the gateway's count when it is there, else the decoders' own."""
    root = _root(spans)
    if root is not None and root["name"] == ROOT_SPAN:
        a = root["attributes"]
        counted = {tier: int(a[f"pdd.tokens.{tier}"]) for tier in ("relay", "main") if f"pdd.tokens.{tier}" in a}
        if counted:
            return counted
    tokens: dict[str, int] = defaultdict(int)
    for span in spans:
        a = span["attributes"]
        if span["name"] == "relay.eager_decode":
            tokens["relay"] += int(a.get("pdd.eager_tokens", 0))
        elif span["name"] == "main.decode":
            tokens["main"] += int(a.get("pdd.tokens", 0))
    return dict(tokens)


def trace_summary(trace_id: str, spans: list[SpanJson]) -> Json:
    t0 = min(int(s["start_ns"]) for s in spans)
    t1 = max(int(s["end_ns"]) for s in spans)
    root = _root(spans)
    attrs: Json = {}
    for span in spans:  # the request's identity, wherever a span carries it
        a = span["attributes"]
        for key in ("pdd.request_id", "pdd.pipeline"):
            if key in a and key not in attrs:
                attrs[key] = a[key]
    root_attrs = root["attributes"] if root is not None else {}
    first_token = next((e for e in (root["events"] if root is not None else []) if e["name"] == "first_token"), None)
    return {
        "trace_id": trace_id, "request_id": attrs.get("pdd.request_id"), "pipeline": attrs.get("pdd.pipeline"),
        "root": root["name"] if root is not None else None, "started_at_s": t0 / 1e9, "duration_ms": (t1 - t0) / 1e6,
        "span_count": len(spans), "services": sorted({_tier(s) for s in spans}),
        "error": any(s["status"]["code"] == "ERROR" for s in spans),
        "http_status": root_attrs.get("http.response.status_code"),
        "ttft_ms": None if first_token is None else (int(first_token["time_ns"]) - t0) / 1e6,
        "tokens": tier_tokens(spans),
    }


def _row_order(span: SpanJson) -> tuple[int, int, str]:
    return TIER_ORDER.get(_tier(span), len(TIER_ORDER)), int(span["start_ns"]), str(span["name"])


def timeline(trace_id: str, spans: list[SpanJson]) -> Json:
    """Rows in tree order (each span after its parent, siblings by start), times in ms from the
    trace's first span."""
    t0 = min(int(s["start_ns"]) for s in spans)
    ids = {s["span_id"] for s in spans}
    children: dict[object, list[SpanJson]] = defaultdict(list)
    for span in spans:
        parent = span["parent_span_id"] if span["parent_span_id"] in ids else None
        children[parent].append(span)
    rows: list[SpanJson] = []

    def visit(span: SpanJson, depth: int) -> None:
        rows.append({
            "span_id": span["span_id"], "parent_span_id": span["parent_span_id"], "name": span["name"],
            "service": span["service"], "tier": _tier(span), "instance": span["instance"], "depth": depth,
            "start_ms": (int(span["start_ns"]) - t0) / 1e6,
            "duration_ms": (int(span["end_ns"]) - int(span["start_ns"])) / 1e6,
            "status": span["status"], "attributes": span["attributes"], "detail": detail(span),
            "events": [{"name": e["name"], "at_ms": (int(e["time_ns"]) - t0) / 1e6, "attributes": e["attributes"]}
                       for e in span["events"]],
            "links": span["links"],
        })
        for child in sorted(children.get(span["span_id"], []), key=_row_order):
            visit(child, depth + 1)

    for root in sorted(children[None], key=_row_order):
        visit(root, 0)
    return {"summary": trace_summary(trace_id, spans), "rows": rows}


class DashboardHandlers:
    def __init__(self, store: TraceStore) -> None:
        self.store = store

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/dashboard", self.page), web.get("/dashboard/api/traces", self.list_traces),
                web.get("/dashboard/api/traces/{trace_id}", self.get_trace)]

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def list_traces(self, request: web.Request) -> web.Response:
        try:
            limit = min(MAX_LIST_LIMIT, max(1, int(request.query.get("limit", DEFAULT_LIST_LIMIT))))
        except ValueError:
            raise web.HTTPBadRequest(text="limit must be an integer") from None
        only_requests = request.query.get("all") != "1"
        summaries = []
        for trace_id in self.store.trace_ids():
            spans = self.store.trace(trace_id)
            if not spans:
                continue
            summary = trace_summary(trace_id, spans)
            if only_requests and summary["request_id"] is None:
                continue  # e.g. a /v1/models call: no stages to show
            summaries.append(summary)
        summaries.sort(key=lambda s: s["started_at_s"], reverse=True)  # type: ignore[arg-type, return-value]
        return web.json_response({"traces": summaries[:limit], "stored": len(self.store)})

    async def get_trace(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        spans = self.store.trace(trace_id)
        if not spans:
            raise web.HTTPNotFound(text=f"no trace {trace_id} in the store")
        return web.json_response(timeline(trace_id.lower(), spans))
