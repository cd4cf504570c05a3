"""WAN emulator: a TCP proxy that makes loopback behave like the long-haul link between A and B.

Owns the shared line (one bandwidth budget per direction for every route and connection, delay,
in-order jitter, a looping bandwidth trace), cuts (reset or blackhole, of every route or of some)
and the byte counters. It knows nothing of what the bytes mean and must not buffer without bound:
each connection holds at most a bandwidth-delay product plus slack, and beyond that the sender
feels TCP backpressure.

It is one module of about 700 lines on purpose: the line's shared budget, the per-connection
pumps and the cut state act on the same queues and clocks, and must change together.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import csv
import enum
import json
import logging
import math
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypedDict

log = logging.getLogger(__name__)

READ_BYTES_MAX = 256 * 1024
READ_BYTES_MIN = 8 * 1024
READ_SLICE_S = 0.005  # on a slow line read ~5 ms of line time at once, so a small message
# on another connection waits behind at most that much per busy connection
BURST_S = 0.005  # credit for timer oversleep; without it every late wake-up would waste line time
UNLIMITED_BUFFER_BYTES = 16 * 1024 * 1024
MIN_BUFFER_BYTES = 1024 * 1024
RATE_WINDOW_S = 1.0
CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
WRITE_HIGH_WATER_BYTES = 1024 * 1024
DIRECTIONS = ("a_to_b", "b_to_a")
PARTIAL = "partial"  # the emulator's summary state while some routes are cut and others are not
JITTER_DISTS = ("uniform", "normal")


@dataclass(frozen=True)
class LinkConfig:
    """What the line does. A non-empty bandwidth_trace overrides bandwidth_bps.

    bandwidth_trace: (t_s, bits_per_second) steps starting at t_s=0, replayed in a loop from the
    moment the config is applied; a step with rate 0 is an outage. trace_period_s=0 means the last
    step lasts as long as the one before it. buffer_bytes=0 sizes the per-connection buffer from
    the bandwidth-delay product.
    """

    bandwidth_bps: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_dist: str = "uniform"
    bandwidth_trace: tuple[tuple[float, float], ...] = ()
    trace_period_s: float = 0.0
    buffer_bytes: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        trace = tuple((float(t), float(bps)) for t, bps in self.bandwidth_trace)
        object.__setattr__(self, "bandwidth_trace", trace)
        for name in ("bandwidth_bps", "delay_ms", "jitter_ms", "trace_period_s", "buffer_bytes"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.jitter_dist not in JITTER_DISTS:
            raise ValueError(f"jitter_dist must be one of {JITTER_DISTS}, got {self.jitter_dist!r}")
        if trace:
            times = [t for t, _ in trace]
            if times[0] != 0.0 or any(b <= a for a, b in zip(times, times[1:], strict=False)):
                raise ValueError("bandwidth_trace times must start at 0 and strictly increase")
            if any(not math.isfinite(bps) or bps < 0 for _, bps in trace) or max(b for _, b in trace) <= 0:
                raise ValueError("bandwidth_trace rates must be >= 0 with at least one > 0")
            if self.trace_period_s and self.trace_period_s <= times[-1]:
                raise ValueError("trace_period_s must be longer than the last trace step's start")

    @property
    def unlimited(self) -> bool:
        return not self.bandwidth_trace and self.bandwidth_bps == 0

    @property
    def peak_bps(self) -> float:
        """Highest rate the line can reach; inf when unlimited."""
        if self.bandwidth_trace:
            return max(bps for _, bps in self.bandwidth_trace)
        return self.bandwidth_bps or math.inf

    @property
    def trace_period(self) -> float:
        trace = self.bandwidth_trace
        if self.trace_period_s or len(trace) < 2:
            return self.trace_period_s or math.inf
        return trace[-1][0] + (trace[-1][0] - trace[-2][0])

    @property
    def connection_buffer_bytes(self) -> int:
        """Bytes one direction of one connection may hold inside the emulator."""
        if self.buffer_bytes:
            return int(self.buffer_bytes)
        if self.unlimited:
            return UNLIMITED_BUFFER_BYTES
        in_flight_s = (self.delay_ms + 3 * self.jitter_ms) / 1000 + 0.05
        return max(MIN_BUFFER_BYTES, int(2 * self.peak_bps / 8 * in_flight_s))


@dataclass(frozen=True)
class Route:
    """One listening port on the emulator, forwarding to an upstream host:port.

    client_side is the datacenter of whoever dials listen_port ("a" or "b"); it decides which
    direction counter the bytes land in.
    """

    name: str
    listen_host: str
    listen_port: int
    upstream_host: str
    upstream_port: int
    client_side: str = "a"

    def __post_init__(self) -> None:
        if self.client_side not in ("a", "b"):
            raise ValueError(f"client_side must be 'a' or 'b', got {self.client_side!r}")

    @property
    def upstream_direction(self) -> str:
        """Direction of bytes from the dialling client to the upstream."""
        return "a_to_b" if self.client_side == "a" else "b_to_a"

    @property
    def downstream_direction(self) -> str:
        return "b_to_a" if self.client_side == "a" else "a_to_b"


class LinkState(enum.Enum):
    """One route's state; a cut of the whole link moves every route."""

    UP = "up"
    RESET = "reset"  # connections torn down with RST, new ones refused
    BLACKHOLE = "blackhole"  # nothing moves, connections stay open, new ones hang


def load_trace(path: str | Path) -> tuple[tuple[float, float], ...]:
    """Read a bandwidth trace from JSON or CSV.

    JSON: [[t_s, bps], ...] or [{"t_s": .., "bps": ..}, ...]. CSV: two columns t_s, rate; an
    optional header names the rate column "bps" or "mbps" (Mbit/s); '#' lines are comments.
    """
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        rows = json.loads(text)
        return tuple((float(r["t_s"]), float(r["bps"])) if isinstance(r, dict) else (float(r[0]), float(r[1]))
                     for r in rows)
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    rows_csv = list(csv.reader(lines))
    scale = 1.0
    if rows_csv and not _is_number(rows_csv[0][0]):
        scale = 1e6 if rows_csv[0][1].strip().lower() == "mbps" else 1.0
        rows_csv = rows_csv[1:]
    return tuple((float(r[0]), float(r[1]) * scale) for r in rows_csv)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class DirectionStats(TypedDict):
    bytes: int  # delivered to the far end since start
    rate_bps: float  # over the last RATE_WINDOW_S


class RouteStats(TypedDict):
    state: str  # "up", "reset" or "blackhole"
    listen_port: int
    upstream: str
    client_side: str
    connections_open: int
    connections_total: int
    refused: int  # accepted while cut with "reset", and reset at once
    upstream_failures: int
    a_to_b: DirectionStats
    b_to_a: DirectionStats


class LinkStats(TypedDict):
    bandwidth_bps: float
    current_bandwidth_bps: float | None  # None: unlimited
    delay_ms: float
    jitter_ms: float
    jitter_dist: str
    trace_steps: int
    connection_buffer_bytes: int


class WanStats(TypedDict):
    """What stats() returns and GET /stats serves."""

    state: str  # "up", "reset" or "blackhole" when every route is so, else "partial"
    cut_routes: dict[str, str]  # route name -> "reset" or "blackhole", for the routes cut now
    link: LinkStats
    connections_open: int
    buffered_bytes: int
    a_to_b: DirectionStats
    b_to_a: DirectionStats
    routes: dict[str, RouteStats]


class RateSchedule:
    """The line rate over time for one LinkConfig applied at `epoch` (monotonic seconds)."""

    def __init__(self, link: LinkConfig, epoch: float) -> None:
        self.unlimited = link.unlimited
        steps = link.bandwidth_trace or ((0.0, link.bandwidth_bps),)
        self._times = [t for t, _ in steps]
        self._rates = [bps for _, bps in steps]
        self._period = link.trace_period
        self._epoch = epoch

    def _segment(self, t: float) -> tuple[float, float]:
        """Rate in effect at t, and the time that step ends."""
        phase = max(0.0, t - self._epoch) % self._period
        i = bisect.bisect_right(self._times, phase) - 1
        step_end = self._times[i + 1] if i + 1 < len(self._times) else self._period
        return self._rates[i], max(t + (step_end - phase), t + 1e-9)

    def rate_at(self, t: float) -> float:
        return math.inf if self.unlimited else self._segment(t)[0]

    def finish_time(self, start: float, bits: float) -> float:
        """When `bits` put on the line at `start` have all left it."""
        if self.unlimited:
            return start
        t = start
        while True:
            rate, step_end = self._segment(t)
            if rate > 0:
                if bits <= rate * (step_end - t):
                    return t + bits / rate
                bits -= rate * (step_end - t)
            t = step_end


class _Meter:
    """Byte total plus the rate over the last RATE_WINDOW_S."""

    def __init__(self) -> None:
        self.total_bytes = 0
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_bytes = 0

    def add(self, nbytes: int, now: float) -> None:
        self.total_bytes += nbytes
        self._recent.append((now, nbytes))
        self._recent_bytes += nbytes
        self._trim(now)

    def rate_bps(self, now: float) -> float:
        self._trim(now)
        return self._recent_bytes * 8 / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] <= now - RATE_WINDOW_S:
            self._recent_bytes -= self._recent.popleft()[1]

    def snapshot(self, now: float) -> DirectionStats:
        return DirectionStats(bytes=self.total_bytes, rate_bps=self.rate_bps(now))


class _Lane:
    """One direction of the shared line: a virtual clock of when the line is next free."""

    def __init__(self, line: _Line) -> None:
        self._line = line
        self._next_free = 0.0
        self.meter = _Meter()

    async def transmit(self, nbytes: int) -> float:
        """Occupy the line for nbytes; return once they have left it, with that time."""
        schedule = self._line.schedule
        now = time.monotonic()
        if schedule.unlimited:
            return now
        start = max(self._next_free, now - BURST_S)
        finish = self._next_free = schedule.finish_time(start, nbytes * 8)
        if finish <= now:
            return now  # burst credit spends line time, but bytes can't leave before they came
        await asyncio.sleep(finish - now)
        return finish


class _Line:
    """The link itself: config, rate schedule, and the two lanes every route shares."""

    def __init__(self, link: LinkConfig) -> None:
        self.config = link
        self.schedule = RateSchedule(link, time.monotonic())
        self.lanes = {d: _Lane(self) for d in DIRECTIONS}
        self._rng = random.Random(link.seed)

    def set_config(self, link: LinkConfig) -> None:
        if link.seed != self.config.seed:
            self._rng = random.Random(link.seed)
        self.config = link
        self.schedule = RateSchedule(link, time.monotonic())

    def one_way_delay_s(self) -> float:
        link = self.config
        delay_ms = link.delay_ms
        if link.jitter_ms:
            if link.jitter_dist == "normal":
                delay_ms += self._rng.gauss(0.0, link.jitter_ms)
            else:
                delay_ms += self._rng.uniform(-link.jitter_ms, link.jitter_ms)
        return max(delay_ms, 0.0) / 1000

    def read_bytes(self) -> int:
        rate_bps = self.schedule.rate_at(time.monotonic())
        if math.isinf(rate_bps):
            return READ_BYTES_MAX
        return int(min(READ_BYTES_MAX, max(READ_BYTES_MIN, rate_bps / 8 * READ_SLICE_S)))


class _Gate:
    """One route's cut state, and an event that is set while the route carries bytes."""

    def __init__(self, route_name: str) -> None:
        self.route_name = route_name
        self.state = LinkState.UP
        self.flowing = asyncio.Event()
        self.flowing.set()

    def move_to(self, state: LinkState) -> None:
        if state is self.state:
            return
        log.info("wan route %s: %s -> %s", self.route_name, self.state.value, state.value)
        self.state = state
        if state is LinkState.UP:
            self.flowing.set()
        else:
            self.flowing.clear()


@dataclass(slots=True)
class _Chunk:
    deliver_at: float
    data: bytes | None  # None: the sender half-closed


class _Pipe:
    """One direction of one connection: chunks on their way, bounded in bytes; in order."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.held_bytes = 0
        self._chunks: deque[_Chunk] = deque()
        self._last_deliver_at = 0.0
        self._ready = asyncio.Event()
        self._room = asyncio.Event()

    async def wait_room(self, nbytes: int) -> None:
        while self.held_bytes and self.held_bytes + nbytes > self.cap_bytes:
            self._room.clear()
            await self._room.wait()

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes
        self._room.set()

    def put(self, deliver_at: float, data: bytes | None) -> None:
        # TCP delivers in order: jitter may stretch gaps but never lets a chunk overtake.
        self._last_deliver_at = max(self._last_deliver_at, deliver_at)
        self._chunks.append(_Chunk(self._last_deliver_at, data))
        self._ready.set()

    async def get(self) -> _Chunk:
        while not self._chunks:
            self._ready.clear()
            await self._ready.wait()
        return self._chunks.popleft()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST so the peer fails at once instead of seeing an orderly end of stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class _RouteStats:
    meters: dict[str, _Meter] = field(default_factory=lambda: {d: _Meter() for d in DIRECTIONS})
    connections_total: int = 0
    refused: int = 0
    upstream_failures: int = 0


class _Connection:
    """A client connection and its upstream twin, pumped both ways through the shared line.

    The reads and writes here wait on the endpoints' own pace and carry no deadline on purpose:
    a real link never times out a slow reader; the endpoints own their deadlines.
    """

    def __init__(self, line: _Line, route: Route, gate: _Gate, stats: _RouteStats,
                 client: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self._line = line
        self.route = route
        self._gate = gate
        self._stats = stats
        self._client = client
        self._upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        cap = line.config.connection_buffer_bytes
        self.pipes = {"up": _Pipe(cap), "down": _Pipe(cap)}
        self.task: asyncio.Task[None] | None = None
        self.peer = client[1].get_extra_info("peername")

    async def run(self) -> None:
        clean = False
        pumps: list[asyncio.Task[None]] = []
        try:
            await self._gate.flowing.wait()  # a blackholed SYN hangs until the route comes back
            self._upstream = await self._dial()
            if self._upstream is None:
                return
            route, up, down = self.route, self.pipes["up"], self.pipes["down"]
            pumps = [
                asyncio.create_task(self._carry(self._client[0], up, route.upstream_direction)),
                asyncio.create_task(self._deliver(up, self._upstream[1], route.upstream_direction)),
                asyncio.create_task(self._carry(self._upstream[0], down, route.downstream_direction)),
                asyncio.create_task(self._deliver(down, self._client[1], route.downstream_direction)),
            ]
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            if errors and isinstance(errors[0], OSError):  # resets and broken pipes: the endpoints' business
                log.debug("wan %s %s: connection failed: %r", route.name, self.peer, errors[0])
            elif errors:
                log.warning("wan %s %s: pump failed", route.name, self.peer, exc_info=errors[0])
            clean = not errors
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if clean:
                await self._close()
            else:
                self.reset()

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        route = self.route
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                upstream = await asyncio.open_connection(route.upstream_host, route.upstream_port,
                                                         limit=READ_BYTES_MAX)
        except asyncio.CancelledError:
            raise
        except (OSError, TimeoutError) as exc:
            self._stats.upstream_failures += 1
            log.warning("wan %s: upstream %s:%d unreachable: %r", route.name, route.upstream_host,
                        route.upstream_port, exc)
            return None
        upstream[1].transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        return upstream

    async def _carry(self, src: asyncio.StreamReader, pipe: _Pipe, direction: str) -> None:
        """Read from one end, put the bytes on the line, and schedule their arrival."""
        line, lane, gate = self._line, self._line.lanes[direction], self._gate
        while True:
            await gate.flowing.wait()
            size = min(line.read_bytes(), pipe.cap_bytes)
            await pipe.wait_room(size)
            data = await src.read(size)
            if not data:
                pipe.put(time.monotonic() + line.one_way_delay_s(), None)
                return
            pipe.hold(len(data))
            await gate.flowing.wait()
            sent_at = await lane.transmit(len(data))
            pipe.put(sent_at + line.one_way_delay_s(), data)

    async def _deliver(self, pipe: _Pipe, dst: asyncio.StreamWriter, direction: str) -> None:
        """Hand chunks to the other end once their arrival time has come."""
        lane_meter, route_meter = self._line.lanes[direction].meter, self._stats.meters[direction]
        while True:
            chunk = await pipe.get()
            wait_s = chunk.deliver_at - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            await self._gate.flowing.wait()
            if chunk.data is None:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            dst.write(chunk.data)
            now = time.monotonic()
            lane_meter.add(len(chunk.data), now)
            route_meter.add(len(chunk.data), now)
            await dst.drain()
            pipe.release(len(chunk.data))

    def reset(self) -> None:
        """Tear both sides down with RST and stop pumping."""
        for end in (self._client, self._upstream):
            if end is not None and not end[1].transport.is_closing():
                _reset(end[1])
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    async def _close(self) -> None:
        for end in (self._client, self._upstream):
            if end is None:
                continue
            end[1].close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await end[1].wait_closed()


class WanEmulator:
    """TCP proxy for one or more routes sharing one emulated WAN line.

    Use as `async with WanEmulator(link, routes) as wan:` or call start() and stop().
    """

    def __init__(self, link: LinkConfig, routes: list[Route]) -> None:
        names = [r.name for r in routes]
        if not routes or len(set(names)) != len(names):
            raise ValueError(f"routes need unique names, got {names}")
        self._routes = {r.name: r for r in routes}
        self._line = _Line(link)
        self._servers: dict[str, asyncio.Server] = {}
        self._route_stats = {name: _RouteStats() for name in names}
        self._gates = {name: _Gate(name) for name in names}
        self._connections: set[_Connection] = set()

    async def __aenter__(self) -> WanEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def link(self) -> LinkConfig:
        return self._line.config

    @property
    def state(self) -> str:
        """"up", "reset" or "blackhole" when every route is in that state, else "partial"."""
        states = {gate.state.value for gate in self._gates.values()}
        return states.pop() if len(states) == 1 else PARTIAL

    def cut_routes(self) -> dict[str, str]:
        """The routes cut now, with their mode."""
        return {name: gate.state.value for name, gate in self._gates.items() if gate.state is not LinkState.UP}

    async def start(self) -> None:
        self._line.set_config(self._line.config)  # the trace replays from start, not construction
        try:
            for route in self._routes.values():
                self._servers[route.name] = await asyncio.start_server(
                    partial(self._accept, route), route.listen_host, route.listen_port, limit=READ_BYTES_MAX)
        except BaseException:
            await self.stop()
            raise
        log.info("wan emulator up: %s", ", ".join(
            f"{r.name} :{self.port(r.name)} -> {r.upstream_host}:{r.upstream_port}" for r in self._routes.values()))

    def port(self, route_name: str) -> int:
        return int(self._servers[route_name].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        for server in self._servers.values():
            server.close()
        conns = list(self._connections)
        for conn in conns:
            conn.reset()
        tasks = [c.task for c in conns if c.task is not None]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.gather(*tasks, return_exceptions=True)
                for server in self._servers.values():
                    await server.wait_closed()
        self._servers.clear()
        totals = {d: lane.meter.total_bytes for d, lane in self._line.lanes.items()}
        log.info("wan emulator stopped: %d connections reset, bytes %s", len(conns), totals)

    def cut(self, mode: str = "reset", routes: Collection[str] | None = None) -> None:
        """Cut every route, or only `routes`: "reset" kills their connections with RST and refuses
        new ones until restore(); "blackhole" freezes their traffic, leaving connections open and
        new ones hanging. The other routes carry on. Cutting a cut route again changes its mode."""
        state = LinkState(mode)
        if state is LinkState.UP:
            raise ValueError("cut mode must be 'reset' or 'blackhole'")
        names = self._named_routes(routes)
        for name in names:
            self._gates[name].move_to(state)
        if state is LinkState.RESET:
            for conn in list(self._connections):
                if conn.route.name in names:
                    conn.reset()

    def restore(self, routes: Collection[str] | None = None) -> None:
        """Bring every route back, or only `routes`."""
        for name in self._named_routes(routes):
            self._gates[name].move_to(LinkState.UP)

    def _named_routes(self, routes: Collection[str] | None) -> set[str]:
        """Every route for None; else the named ones, which must exist (one bad name: nothing changes)."""
        if routes is None:
            return set(self._routes)
        names = {routes} if isinstance(routes, str) else set(routes)
        if not names:
            raise ValueError(f"name at least one route of {sorted(self._routes)}")
        if unknown := sorted(names - set(self._routes)):
            raise ValueError(f"unknown routes {unknown}; this emulator has {sorted(self._routes)}")
        return names

    def set_link(self, link: LinkConfig) -> None:
        """Change the line live; a new trace starts replaying now. Open connections keep their
        buffer bound; new ones get the new one."""
        self._line.set_config(link)
        log.info("wan link set: %s", link)

    def _accept(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback: the connection task is ours to own and cancel (3.11's start_server
        # logs a cancelled handler task as an error).
        stats = self._route_stats[route.name]
        stats.connections_total += 1
        if self._gates[route.name].state is LinkState.RESET:
            stats.refused += 1
            _reset(writer)
            return
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        conn = _Connection(self._line, route, self._gates[route.name], stats, (reader, writer))
        conn.task = asyncio.create_task(conn.run(), name=f"wan-{route.name}-{conn.peer}")
        conn.task.add_done_callback(partial(self._connection_done, conn))
        self._connections.add(conn)

    def _connection_done(self, conn: _Connection, task: asyncio.Task[None]) -> None:
        self._connections.discard(conn)
        if not task.cancelled() and task.exception() is not None:
            log.error("wan %s %s: connection task failed", conn.route.name, conn.peer, exc_info=task.exception())

    def stats(self) -> WanStats:
        now = time.monotonic()
        line, link = self._line, self._line.config
        open_by_route = {name: 0 for name in self._routes}
        for conn in self._connections:
            open_by_route[conn.route.name] += 1
        routes: dict[str, RouteStats] = {}
        for name, st in self._route_stats.items():
            route = self._routes[name]
            routes[name] = RouteStats(
                state=self._gates[name].state.value,
                listen_port=self.port(name) if name in self._servers else route.listen_port,
                upstream=f"{route.upstream_host}:{route.upstream_port}",
                client_side=route.client_side,
                connections_open=open_by_route[name],
                connections_total=st.connections_total,
                refused=st.refused,
                upstream_failures=st.upstream_failures,
                a_to_b=st.meters["a_to_b"].snapshot(now),
                b_to_a=st.meters["b_to_a"].snapshot(now),
            )
        rate_now = line.schedule.rate_at(now)
        return WanStats(
            state=self.state,
            cut_routes=self.cut_routes(),
            link=LinkStats(
                bandwidth_bps=link.bandwidth_bps,
                current_bandwidth_bps=None if math.isinf(rate_now) else rate_now,
                delay_ms=link.delay_ms,
                jitter_ms=link.jitter_ms,
                jitter_dist=link.jitter_dist,
                trace_steps=len(link.bandwidth_trace),
                connection_buffer_bytes=link.connection_buffer_bytes,
            ),
            connections_open=len(self._connections),
            buffered_bytes=sum(p.held_bytes for c in self._connections for p in c.pipes.values()),
            a_to_b=line.lanes["a_to_b"].meter.snapshot(now),
            b_to_a=line.lanes["b_to_a"].meter.snapshot(now),
            routes=routes,
        )
