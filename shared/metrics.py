"""Every Prometheus metric pdd exports, in one place, one class per role.

Each role's metrics live in their own CollectorRegistry, so a service's /metrics shows only its
own series. The gateway serves its registry on its API port; P, RLD and MD on `--metrics-port`
(`serve`). Names start with `pdd_`; seconds and bytes are in the names, as Prometheus asks.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from shared import gc_heap
from shared.loop_lag import LoopLagMonitor

log = logging.getLogger(__name__)
disable_created_metrics()  # the *_created series only double every counter; none of our dashboards read them

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
# actual minus predicted: negative means MD was ready sooner than the policy thought
ERROR_BUCKETS_S = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
LOOP_LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
TRANSFER_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class _RoleMetrics:
    """What every service has: its registry, the process' own collector, load gauges, aborts."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(gc_heap.shared().collector())
        r = self.registry
        self.running_requests = Gauge("pdd_running_requests", "Requests held by this service now", registry=r)
        self.queue_depth = Gauge(
            "pdd_queue_depth", "Work waiting to start: engine calls queued (P, RLD, MD); requests with no "
            "token yet (gateway)", registry=r)
        self.aborts = Counter("pdd_aborts", "Aborts by reason: every one the gateway broadcast; on P, RLD and "
                              "MD those that found the request still running", ["reason"], registry=r)

        self.event_loop_lag = Histogram(
            "pdd_event_loop_lag_seconds", "How much later than asked the event loop woke from a 50 ms sleep: "
            "time it could not read its sockets", buckets=LOOP_LAG_BUCKETS_S, registry=r)
        self.event_loop_lag_max = Gauge("pdd_event_loop_lag_max_seconds", "The event loop's longest lag since start",
                                        registry=r)

    def loop_lag_monitor(self) -> LoopLagMonitor:
        """A monitor of the event loop's lag that reports into these metrics; `start()` it on the loop."""
        monitor = LoopLagMonitor(self.event_loop_lag.observe)
        self.event_loop_lag_max.set_function(lambda: monitor.max_lag_s)
        return monitor

    def track_load(self, running: Callable[[], float], queued: Callable[[], float]) -> None:
        self.running_requests.set_function(running)
        self.queue_depth.set_function(queued)


class GatewayMetrics(_RoleMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.http_responses = Counter("pdd_http_responses", "API responses by route and HTTP status "
                                      "(499: the client went away)", ["route", "status"], registry=r)
        self.requests = Counter("pdd_requests", "Requests dispatched to a pipeline, by how they ended (finished, "
                                "stop_string, client_disconnected, error, ...)", ["pipeline", "outcome"], registry=r)
        self.ttft = Histogram("pdd_ttft_seconds", "Time to first token, from the HTTP request to the first token "
                              "handed to the client", ["pipeline"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.time_per_output_token = Histogram(
            "pdd_time_per_output_token_seconds", "Per request: (last token - first token) / (tokens - 1)",
            ["pipeline"], buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.inter_token = Histogram("pdd_inter_token_seconds", "Every gap between two consecutive tokens",
                                     ["pipeline"], buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.output_tokens = Counter("pdd_output_tokens", "Tokens sent to clients, by the tier that made them",
                                     ["pipeline", "tier"], registry=r)
        self.main_kv_releases = Counter("pdd_main_kv_releases", "Held MD KV streams released because RLD no longer "
                                        "looked like finishing first", registry=r)
        self.finished_on_relay = Counter("pdd_finished_on_relay", "Attempts with an MD that RLD finished alone "
                                         "(MD made no token)", registry=r)
        self.pipeline_decisions = Counter("pdd_pipeline_decisions", "The policy's choice per request",
                                          ["pipeline", "reason"], registry=r)
        self.main_ready_error = Histogram(
            "pdd_policy_main_ready_error_seconds", "MD's KV ready time: actual minus predicted",
            buckets=ERROR_BUCKETS_S, registry=r)
        self.handoffs = Counter("pdd_handoffs", "RLD-to-MD handoffs seen by the client, by mode", ["mode"],
                                registry=r)
        self.handoff_stall = Histogram(
            "pdd_handoff_stall_seconds", "The gap a client sees between RLD's last and MD's first token",
            ["mode"], buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.recoveries = Counter("pdd_recoveries", "Requests kept alive after losing a tier, by what was done "
                                  "(finish_on_relay, main_takes_over, migrate)", ["action"], registry=r)
        self.live_instances = Gauge("pdd_live_instances", "Instances heard from lately (heartbeats or answered "
                                    "pings)", ["role"], registry=r)
        self.tier_losses = Counter("pdd_tier_losses", "Tiers a request lost, by how: gone (the instance stopped "
                                   "answering), failed (it reported the request failed) or preempted (its KV "
                                   "budget was full; the request restarts)", ["tier", "cause"],
                                   registry=r)
        self.instances_gone = Counter("pdd_instances_gone", "Instances found dead: a liveness ping nobody was "
                                      "there to answer", ["role"], registry=r)
        self.instance_waits = Counter("pdd_instance_waits", "Requests that found no live instance of a role and "
                                      "waited for one (--instance-wait-s), by whether one came", ["role", "outcome"],
                                      registry=r)
        self.queued_requests = Gauge("pdd_gateway_queued_requests", "API requests waiting at admission for one "
                                     "of --max-running-requests to end (at most --max-queued-requests)", registry=r)


class PrefillMetrics(_RoleMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.prompt_tokens = Counter("pdd_prompt_tokens", "Prompt tokens whose KV was asked for (all but the last)",
                                     registry=r)
        self.cache_hit_tokens = Counter("pdd_cache_hit_tokens", "Prompt tokens served from P's prefix cache",
                                        registry=r)
        self.computed_tokens = Counter("pdd_prefill_computed_tokens", "Prompt tokens P computed", registry=r)
        self.warmed_tokens = Counter("pdd_prefill_warmed_tokens", "Tokens of running answers P computed into its "
                                     "prefix cache (warm-ups, not counted as prompt tokens)", registry=r)
        self.prefill_time = Histogram("pdd_prefill_seconds", "P's compute time per request",
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_bytes = Counter("pdd_kv_transfer_bytes", "KV bytes sent (frame headers included), by target role",
                                ["target"], registry=r)
        self.kv_transfer_time = Histogram("pdd_kv_transfer_seconds", "One KV path from start to its last frame written",
                                          ["target"], buckets=TRANSFER_BUCKETS_S, registry=r)
        self.kv_transfers = Counter("pdd_kv_transfers", "KV paths by target role and outcome (done, failed, aborted)",
                                    ["target", "outcome"], registry=r)
        self.kv_held_paths = Counter("pdd_kv_held_paths", "KV paths held back while RLD was predicted to finish "
                                     "first, by outcome (released, never_sent, backfilled)", ["outcome"], registry=r)
        self.backfill_bytes = Counter("pdd_kv_backfill_bytes", "KV bytes sent to MD in the background, after RLD "
                                      "finished the request alone, for MD's DRC (frame headers included)", registry=r)
        self.backfills = Counter("pdd_kv_backfills", "MD paths moved to the background because RLD finished first, "
                                 "by outcome (done, failed, aborted)", ["outcome"], registry=r)
        self.relay_finished_wan_bytes = Counter("pdd_relay_finished_wan_bytes", "KV bytes sent toward MD for "
                                                "requests RLD finished alone (frame headers included)", registry=r)
        self.relay_finished_kv_bytes = Counter("pdd_relay_finished_kv_bytes", "KV MD lacked of the requests RLD "
                                               "finished alone: what a full transfer would have sent", registry=r)


class DecoderMetrics(_RoleMetrics):
    """What RLD and MD share; the scrape target tells them apart."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.cache_hit_tokens = Counter("pdd_cache_hit_tokens", "Prompt tokens served from MD's DRC", registry=r)
        self.kv_received_bytes = Counter("pdd_kv_received_bytes", "KV payload bytes received", registry=r)
        self.kv_wait = Histogram("pdd_kv_wait_seconds", "From assignment until the request's KV was complete",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.output_tokens = Counter("pdd_output_tokens", "Tokens this decoder made and published", registry=r)
        self.handoffs = Counter("pdd_handoffs", "Handoffs (MD: taken over; RLD: handed over), by mode", ["mode"],
                                registry=r)


class RelayMetrics(DecoderMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.eager_tokens = Histogram("pdd_eager_tokens", "Tokens RLD made before the cut, per request",
                                      buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=self.registry)


class MainMetrics(DecoderMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.handoff_extend = Histogram(
            "pdd_handoff_extend_seconds", "The extend-decode pass after the cut (MD's share of the stall)",
            ["mode"], buckets=TOKEN_GAP_BUCKETS_S, registry=self.registry)


def decoder_metrics(role: str) -> DecoderMetrics:
    return {"relay": RelayMetrics, "main": MainMetrics}.get(role, DecoderMetrics)()


@dataclass
class MetricsServer:
    """prometheus-client's own threaded HTTP server for one registry."""

    host: str
    port: int
    _server: object

    def close(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve(registry: CollectorRegistry, host: str, port: int) -> MetricsServer | None:
    """GET /metrics on host:port in a daemon thread; port 0 means no server."""
    if port <= 0:
        return None
    server, _ = start_http_server(port, host, registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return MetricsServer(host, server.server_port, server)
