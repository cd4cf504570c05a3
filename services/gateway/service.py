"""Gateway service shell: the HTTP server, the NATS connection and the instance registry.

Requests come in over the OpenAI API (services/gateway/http/openai_api.py) and go through the
Dispatcher; instances are known from their heartbeats.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.http.admission import Admission, key_middleware
from services.gateway.http.http_errors import error_middleware
from services.gateway.http.openai_api import OpenAIHandlers
from services.gateway.observe.dashboard import DashboardHandlers
from services.gateway.observe.request_telemetry import (
    RequestTelemetry,
    tracing_middleware,
)
from services.gateway.observe.trace_store import OtlpReceiver, TraceStore
from services.gateway.routing.cache_index import CacheIndex
from services.gateway.routing.dispatcher import Dispatcher
from services.gateway.routing.liveness import ping_instances
from services.gateway.routing.registry import InstanceRegistry
from shared import bus, messages, subjects
from shared.config import GatewayConfig, read_secret
from shared.errors import PddError
from shared.messages import CacheEvents, Heartbeat
from shared.metrics import GatewayMetrics
from shared.models import (
    load_tokenizer,
    max_context_tokens,
    resolve_model,
    served_model_name,
)
from shared.names import Role

log = logging.getLogger(__name__)

HEALTH_ANSWER_WITHIN_S = 1.0  # a few liveness pings (every 0.25 s, each allowed 0.5 s)
STALE_HEARTBEATS = 3.5  # an instance is gone after this many missed heartbeat intervals
# Open without the API key: probes, scrapes, and the dashboard's page (its data routes need the key).
OPEN_PATHS = frozenset({"/healthz", "/metrics", "/dashboard"})


class GatewayService:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.dispatcher: Dispatcher | None = None  # made once NATS is connected
        path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(path)
        self.served_model = served_model_name(path)
        self.max_context_tokens = max_context_tokens(path)
        self.cache_index = CacheIndex()
        self.metrics = GatewayMetrics()
        self.loop_lag = self.metrics.loop_lag_monitor()
        self.registry = InstanceRegistry(stale_after_s=STALE_HEARTBEATS * config.common.heartbeat_s,
                                         on_gone=self._on_gone, clock=self.loop_lag.clock)
        for role in Role:
            self.metrics.live_instances.labels(role).set_function(self._live_count(role))
        api_key = read_secret(config.api_key_file)
        self.admission = Admission(config.max_running_requests, config.max_queued_requests,
                                   api_key.decode() if api_key else None)
        self.metrics.queued_requests.set_function(lambda: self.admission.queued)
        self.trace_store = TraceStore(config.trace_store_traces)
        self.otlp_receiver = OtlpReceiver(self.trace_store, config.otlp_forward_endpoint, config.body_timeout_s)

    async def start(self) -> None:
        common = self.config.common
        self.loop_lag.start()
        self.nc = await bus.connect(common.nats_url, common.instance_id, common.nats_auth)
        await self.nc.subscribe(subjects.heartbeat_all(), cb=self._on_heartbeat)
        await self.nc.subscribe(subjects.cache_events_all(), cb=self._on_cache_events)
        self.dispatcher = Dispatcher(self.nc, self.registry, self.config, self.cache_index, metrics=self.metrics)
        await self.dispatcher.listen()
        self.liveness = asyncio.create_task(
            ping_instances(self.nc, self.registry, self.dispatcher.costs.observe_round_trip), name="liveness")
        self.handlers = handlers = OpenAIHandlers(self.dispatcher, self.tokenizer, self.served_model, self.config,
                                  self.max_context_tokens, self.admission, RequestTelemetry(self.metrics))
        app = web.Application(middlewares=[error_middleware, tracing_middleware(self.metrics),
                                           key_middleware(self.admission, OPEN_PATHS)],
                              client_max_size=self.config.max_body_bytes)
        app.add_routes([*handlers.routes(), web.get("/healthz", self._healthz), web.get("/metrics", self._metrics),
                        *self.otlp_receiver.routes(), *DashboardHandlers(self.trace_store).routes()])
        # aiohttp's keep-alive timer also closes a connection whose request head is still incomplete:
        # it is the header read timeout (the body has its own deadline, in read_body).
        self.runner = web.AppRunner(app, shutdown_timeout=5.0, keepalive_timeout=self.config.header_timeout_s)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        log.info("OpenAI API on http://%s:%d/v1", self.config.host, self.port)

    async def stop(self) -> None:
        self.loop_lag.stop()
        self.liveness.cancel()
        await asyncio.gather(self.liveness, return_exceptions=True)
        await self.runner.cleanup()
        self.handlers.close()
        await self.otlp_receiver.close()
        await self.nc.drain()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            heartbeat = messages.decode_as(msg.data, Heartbeat)
            self.registry.observe(heartbeat)
            if heartbeat.held and self.dispatcher is not None:
                await self.dispatcher.abort_orphans(heartbeat)
        except PddError as exc:
            log.debug("bad heartbeat: %s", exc)

    def _live_count(self, role: Role) -> Callable[[], float]:
        return lambda: len(self.registry.alive(role))

    def _on_gone(self, instance_id: str) -> None:
        """A ping found nobody: the instance's caches died with it."""
        instance = self.registry.get(instance_id)
        if instance is not None:
            self.metrics.instances_gone.labels(instance.heartbeat.role).inc()
        self.cache_index.forget(instance_id)

    async def _on_cache_events(self, msg: Msg) -> None:
        try:
            events = messages.decode_as(msg.data, CacheEvents)
        except PddError as exc:
            log.debug("bad cache events: %s", exc)
            return
        self.cache_index.apply(events.instance_id, events.events)

    async def _healthz(self, request: web.Request) -> web.Response:
        """Healthy when every role has an instance that answered a liveness ping just now (heartbeats
        alone only prove the path from the instance to here; after a WAN cut the other may lag)."""
        heard = {str(role): len(self.registry.alive(role)) for role in Role}
        counts = {str(role): len(self.registry.answering(role, HEALTH_ANSWER_WITHIN_S)) for role in Role}
        ok = all(counts.values()) and self.nc.is_connected
        return web.json_response({"status": "ok" if ok else "degraded", "instances": counts, "heard": heard,
                                  "requests": {"running": self.admission.running, "queued": self.admission.queued}},
                                 status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
