"""Entry point for the WAN emulator: `python -m wan --route kv=HOST:PORT->HOST:PORT ...`.

Owns the flags, the optional HTTP control API (stats, cut, restore, live link changes) and the
process lifetime; the emulation itself lives in wan/emulator.py.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from wan.emulator import LinkConfig, Route, WanEmulator, load_trace

log = logging.getLogger(__name__)

EMULATOR_KEY = web.AppKey("emulator", WanEmulator)
LINK_FIELDS = {f.name for f in dataclasses.fields(LinkConfig)}


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PDD_WAN_{name}", default)


def _split_host_port(text: str, default_host: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return default_host, int(port)
    return host.strip("[]") or default_host, int(port)


def parse_route(spec: str) -> Route:
    """`name[@b]=[LISTEN_HOST:]LISTEN_PORT->UPSTREAM_HOST:UPSTREAM_PORT`; `@b` marks a route
    dialled from datacenter B (default A)."""
    try:
        name, listen_upstream = spec.split("=", 1)
        name, _, side = name.partition("@")
        listen, upstream = listen_upstream.split("->", 1)
        listen_host, listen_port = _split_host_port(listen, "127.0.0.1")
        upstream_host, upstream_port = _split_host_port(upstream, "127.0.0.1")
        return Route(name.strip(), listen_host, listen_port, upstream_host, upstream_port, side or "a")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad route {spec!r}: {exc}") from exc


def link_from_json(current: LinkConfig, body: dict[str, object]) -> LinkConfig:
    """Apply a partial update given as LinkConfig field names (plus bandwidth_mbps for short)."""
    changes = dict(body)
    if "bandwidth_mbps" in changes:
        changes["bandwidth_bps"] = float(changes.pop("bandwidth_mbps")) * 1e6  # type: ignore[arg-type]
    unknown = set(changes) - LINK_FIELDS
    if unknown:
        raise ValueError(f"unknown link fields: {sorted(unknown)}")
    if "bandwidth_trace" in changes:
        trace = changes["bandwidth_trace"]
        if not isinstance(trace, list):
            raise ValueError("bandwidth_trace must be a list of [t_s, bps] pairs")
        changes["bandwidth_trace"] = tuple(tuple(step) for step in trace)
    return dataclasses.replace(current, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WanMainConfig:
    routes: tuple[Route, ...]
    link: LinkConfig
    control_host: str
    control_port: int | None  # None: no control API; 0 picks a free port
    log_level: str

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m wan", description="pdd WAN emulator (TCP proxy)")
        p.add_argument("--route", action="append", type=parse_route, required=True,
                       help="name[@b]=[LHOST:]LPORT->UHOST:UPORT; repeat for more routes; @b: dialled from B")
        p.add_argument("--bandwidth-mbps", type=float, default=float(_env("BANDWIDTH_MBPS", "0")),
                       help="line rate per direction in Mbit/s; 0: unlimited")
        p.add_argument("--delay-ms", type=float, default=float(_env("DELAY_MS", "0")), help="one-way delay")
        p.add_argument("--jitter-ms", type=float, default=float(_env("JITTER_MS", "0")),
                       help="± spread on the one-way delay (never reorders bytes)")
        p.add_argument("--jitter-dist", choices=("uniform", "normal"), default=_env("JITTER_DIST", "uniform"))
        p.add_argument("--trace", default=_env("TRACE", ""),
                       help="bandwidth trace, looped: CSV t_s,bps (or header t_s,mbps) or JSON [[t_s,bps],..]; "
                            "overrides --bandwidth-mbps")
        p.add_argument("--trace-period-s", type=float, default=0.0,
                       help="loop length of the trace; 0: last step lasts as long as the one before")
        p.add_argument("--buffer-bytes", type=int, default=0,
                       help="bytes held per connection and direction; 0: from the bandwidth-delay product")
        p.add_argument("--seed", type=int, default=0, help="jitter random seed")
        p.add_argument("--control-host", default=_env("CONTROL_HOST", "127.0.0.1"))
        p.add_argument("--control-port", type=int, default=None,
                       help="HTTP control API port (GET /stats, POST /cut[?routes=a,b], /restore, /link); "
                            "0 picks one; unset: off")
        p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WanMainConfig:
        parser = cls.parser()
        ns = parser.parse_args(argv)
        try:
            link = LinkConfig(
                bandwidth_bps=ns.bandwidth_mbps * 1e6, delay_ms=ns.delay_ms, jitter_ms=ns.jitter_ms,
                jitter_dist=ns.jitter_dist, bandwidth_trace=load_trace(ns.trace) if ns.trace else (),
                trace_period_s=ns.trace_period_s, buffer_bytes=ns.buffer_bytes, seed=ns.seed)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        return cls(tuple(ns.route), link, ns.control_host, ns.control_port, ns.log_level)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def _stats(request: web.Request) -> web.Response:
    return _json(request.app[EMULATOR_KEY].stats())


async def _healthz(request: web.Request) -> web.Response:
    return _json({"ok": True, "state": request.app[EMULATOR_KEY].state})


def _routes_param(request: web.Request) -> list[str] | None:
    """`routes=a,b` (or the parameter repeated); absent: every route."""
    values = request.query.getall("routes", [])
    if not values:
        return None
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _cut_state(emulator: WanEmulator) -> web.Response:
    return _json({"state": emulator.state, "cut_routes": emulator.cut_routes()})


async def _cut(request: web.Request) -> web.Response:
    emulator = request.app[EMULATOR_KEY]
    emulator.cut(request.query.get("mode", "reset"), _routes_param(request))
    return _cut_state(emulator)


async def _restore(request: web.Request) -> web.Response:
    emulator = request.app[EMULATOR_KEY]
    emulator.restore(_routes_param(request))
    return _cut_state(emulator)


async def _link(request: web.Request) -> web.Response:
    emulator = request.app[EMULATOR_KEY]
    body = orjson.loads(await request.read())
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object of LinkConfig fields")
    emulator.set_link(link_from_json(emulator.link, body))
    return _json(emulator.stats()["link"])


@web.middleware
async def _bad_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where a bad control request becomes an HTTP error."""
    try:
        return await handler(request)
    except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
        return _json({"error": str(exc)}, status=400)


def build_control_app(emulator: WanEmulator) -> web.Application:
    app = web.Application(middlewares=[_bad_request])
    app[EMULATOR_KEY] = emulator
    app.router.add_get("/stats", _stats)
    app.router.add_get("/healthz", _healthz)
    app.router.add_post("/cut", _cut)
    app.router.add_post("/restore", _restore)
    app.router.add_post("/link", _link)
    return app


async def run(config: WanMainConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            os._exit(1)  # second signal: the operator wants out now
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    runner: web.AppRunner | None = None
    async with WanEmulator(config.link, list(config.routes)) as emulator:
        listening = [f"{r.name}{'@b' if r.client_side == 'b' else ''}={r.listen_host}:{emulator.port(r.name)}"
                     f"->{r.upstream_host}:{r.upstream_port}" for r in config.routes]
        try:
            if config.control_port is not None:
                runner = web.AppRunner(build_control_app(emulator), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, config.control_host, config.control_port)
                await site.start()
                port = runner.addresses[0][1]
                listening.append(f"control=http://{config.control_host}:{port}")
            print("wan_emulator listening: " + " ".join(listening), flush=True)
            await stop.wait()
            log.info("wan emulator: signal received, shutting down")
        finally:
            if runner is not None:
                await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    config = WanMainConfig.from_argv(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
