"""The WAN emulator moves bytes unchanged, at the configured rate and delay, and cuts on command."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from wan.emulator import LinkConfig, LinkState, RateSchedule, Route, WanEmulator, load_trace
from wan.main import link_from_json, parse_route

REPO_ROOT = Path(__file__).resolve().parents[1]
MB = 1_000_000
DEADLINE_S = 10.0


@dataclass
class Received:
    """What the upstream sink saw on one connection."""

    nbytes: int = 0
    sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, cumulative bytes)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None


class Upstream:
    """A loopback server on the B side: 'echo' sends everything back, 'sink' only counts,
    'stall' accepts and never reads."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections: list[Received] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._accepted = asyncio.Event()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def connection(self, index: int) -> Received:
        async with asyncio.timeout(DEADLINE_S):
            while len(self.connections) <= index:
                self._accepted.clear()
                await self._accepted.wait()
        return self.connections[index]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        got = Received()
        self.connections.append(got)
        self._accepted.set()
        try:
            if self.mode == "stall":
                await asyncio.Event().wait()
            while data := await reader.read(256 * 1024):
                got.nbytes += len(data)
                got.sha256.update(data)
                got.arrivals.append((time.monotonic(), got.nbytes))
                if self.mode == "echo":
                    writer.write(data)
                    await writer.drain()
            writer.close()
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            got.error = exc
            writer.transport.abort()
        finally:
            got.ended.set()
            self._handlers.discard(task)


@pytest.fixture
async def echo() -> AsyncIterator[Upstream]:
    upstream = Upstream("echo")
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture
async def sink() -> AsyncIterator[Upstream]:
    upstream = Upstream("sink")
    await upstream.start()
    yield upstream
    await upstream.stop()


def route_to(upstream: Upstream, name: str = "kv", client_side: str = "a") -> Route:
    assert upstream._server is not None
    return Route(name, "127.0.0.1", 0, "127.0.0.1", int(upstream._server.sockets[0].getsockname()[1]), client_side)


async def connect(wan: WanEmulator, route: str = "kv") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(DEADLINE_S):
        return await asyncio.open_connection("127.0.0.1", wan.port(route))


async def send_all(writer: asyncio.StreamWriter, payload: bytes) -> None:
    view = memoryview(payload)
    for i in range(0, len(payload), 256 * 1024):
        writer.write(view[i:i + 256 * 1024])
        await writer.drain()
    writer.write_eof()


async def read_n(reader: asyncio.StreamReader, n: int) -> bytes:
    async with asyncio.timeout(DEADLINE_S):
        return await reader.readexactly(n)


async def wait_ended(got: Received, timeout_s: float = DEADLINE_S) -> None:
    async with asyncio.timeout(timeout_s):
        await got.ended.wait()


async def test_bytes_pass_unchanged_both_ways_and_are_counted(echo: Upstream) -> None:
    payload = os.urandom(4 * MB)
    async with WanEmulator(LinkConfig(), [route_to(echo)]) as wan:
        reader, writer = await connect(wan)
        sender = asyncio.create_task(send_all(writer, payload))
        back = await read_n(reader, len(payload))
        await sender
        async with asyncio.timeout(DEADLINE_S):
            assert await reader.read() == b""
        writer.close()
        assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
        assert echo.connections[0].sha256.digest() == hashlib.sha256(payload).digest()
        stats = wan.stats()
    assert stats["a_to_b"]["bytes"] == len(payload)
    assert stats["b_to_a"]["bytes"] == len(payload)
    assert stats["routes"]["kv"]["a_to_b"]["bytes"] == len(payload)


async def test_route_dialled_from_b_counts_its_uploads_as_b_to_a(sink: Upstream) -> None:
    async with WanEmulator(LinkConfig(), [route_to(sink, "nats", client_side="b")]) as wan:
        _, writer = await connect(wan, "nats")
        await send_all(writer, b"x" * 100_000)
        await wait_ended(await sink.connection(0))
        writer.close()
        stats = wan.stats()
    assert stats["b_to_a"]["bytes"] == 100_000
    assert stats["a_to_b"]["bytes"] == 0


async def test_transfer_time_follows_bandwidth_and_delay(sink: Upstream) -> None:
    bandwidth_bps, delay_s, nbytes = 40e6, 0.050, 2 * MB
    async with WanEmulator(LinkConfig(bandwidth_bps=bandwidth_bps, delay_ms=delay_s * 1000), [route_to(sink)]) as wan:
        _, writer = await connect(wan)
        t0 = time.monotonic()
        await send_all(writer, os.urandom(nbytes))
        await wait_ended(await sink.connection(0))
        elapsed_s = sink.connections[0].arrivals[-1][0] - t0
        writer.close()
        expected_s = nbytes * 8 / bandwidth_bps + delay_s
        assert 0.7 * expected_s <= elapsed_s <= 2.0 * expected_s, (elapsed_s, expected_s)
        first_arrival_s = sink.connections[0].arrivals[0][0] - t0
        assert first_arrival_s >= delay_s * 0.9
        assert wan.stats()["a_to_b"]["bytes"] == nbytes


async def test_two_connections_share_one_line(sink: Upstream) -> None:
    bandwidth_bps, nbytes = 40e6, 1 * MB
    async with WanEmulator(LinkConfig(bandwidth_bps=bandwidth_bps), [route_to(sink)]) as wan:
        conns = [await connect(wan), await connect(wan)]
        t0 = time.monotonic()
        await asyncio.gather(*(send_all(w, os.urandom(nbytes)) for _, w in conns))
        for i in range(2):
            await wait_ended(await sink.connection(i))
        finished_s = sorted(got.arrivals[-1][0] - t0 for got in sink.connections)
        for _, w in conns:
            w.close()
    together_s = 2 * nbytes * 8 / bandwidth_bps
    assert 0.7 * together_s <= finished_s[1] <= 2.0 * together_s, finished_s
    # Shared, not serialised: the first to finish was slowed by the other one too.
    assert finished_s[0] >= 0.6 * together_s, finished_s


@pytest.mark.parametrize(("bandwidth_bps", "jitter_ms"), [(0.0, 5.0), (100e6, 0.0)])
async def test_round_trip_takes_at_least_twice_the_one_way_delay(
        echo: Upstream, bandwidth_bps: float, jitter_ms: float) -> None:
    delay_s = 0.040
    link = LinkConfig(bandwidth_bps=bandwidth_bps, delay_ms=delay_s * 1000, jitter_ms=jitter_ms)
    async with WanEmulator(link, [route_to(echo)]) as wan:
        reader, writer = await connect(wan)
        rtts = []
        for i in range(5):
            t0 = time.monotonic()
            writer.write(b"ping%d" % i)
            assert await read_n(reader, 5) == b"ping%d" % i
            rtts.append(time.monotonic() - t0)
        writer.close()
    assert min(rtts) >= 2 * (delay_s - jitter_ms / 1000) * 0.98, rtts
    assert max(rtts) < 1.0, rtts


async def test_jitter_never_reorders_bytes(echo: Upstream) -> None:
    payload = os.urandom(1 * MB)
    link = LinkConfig(bandwidth_bps=200e6, delay_ms=5, jitter_ms=5, jitter_dist="normal", seed=7)
    async with WanEmulator(link, [route_to(echo)]) as wan:
        reader, writer = await connect(wan)
        sender = asyncio.create_task(send_all(writer, payload))
        assert await read_n(reader, len(payload)) == payload
        await sender
        writer.close()


async def test_reset_cut_fails_both_ends_and_refuses_until_restored(echo: Upstream) -> None:
    async with WanEmulator(LinkConfig(bandwidth_bps=20e6, delay_ms=10), [route_to(echo)]) as wan:
        reader, writer = await connect(wan)
        writer.write(b"hello")
        assert await read_n(reader, 5) == b"hello"
        writer.write(os.urandom(2 * MB))  # still in flight when the line goes

        wan.cut("reset")
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read_n(reader, 2 * MB)
        await wait_ended(await echo.connection(0), timeout_s=2.0)
        assert time.monotonic() - t0 < 2.0
        writer.transport.abort()

        reader2, writer2 = await connect(wan)  # accepted by the kernel, then reset at once
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            async with asyncio.timeout(2.0):
                await reader2.readexactly(1)
        writer2.transport.abort()
        stats = wan.stats()
        assert stats["state"] == "reset" and stats["routes"]["kv"]["refused"] == 1
        assert len(echo.connections) == 1  # the refused connection never reached upstream

        wan.restore()
        reader3, writer3 = await connect(wan)
        writer3.write(b"again")
        assert await read_n(reader3, 5) == b"again"
        writer3.close()


async def test_unreachable_upstream_resets_the_client() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    closed_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with WanEmulator(LinkConfig(), [Route("kv", "127.0.0.1", 0, "127.0.0.1", closed_port)]) as wan:
        reader, writer = await connect(wan)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read_n(reader, 1)
        writer.transport.abort()
        assert wan.stats()["routes"]["kv"]["upstream_failures"] == 1


async def test_blackhole_freezes_bytes_but_keeps_connections_open(echo: Upstream) -> None:
    async with WanEmulator(LinkConfig(delay_ms=5), [route_to(echo)]) as wan:
        reader, writer = await connect(wan)
        writer.write(b"before")
        assert await read_n(reader, 6) == b"before"

        wan.cut("blackhole")
        writer.write(b"during")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await reader.readexactly(6)
        assert not writer.is_closing() and not echo.connections[0].ended.is_set()
        stats = wan.stats()
        assert stats["state"] == "blackhole" and stats["connections_open"] == 1
        assert stats["a_to_b"]["bytes"] == 6

        wan.restore()  # like TCP retransmission after the outage: nothing was lost
        assert await read_n(reader, 6) == b"during"
        writer.close()


async def test_a_cut_of_some_routes_leaves_the_others_carrying_bytes(echo: Upstream) -> None:
    async with WanEmulator(LinkConfig(delay_ms=5), [route_to(echo, "gw"), route_to(echo, "kv")]) as wan:
        gw_reader, gw_writer = await connect(wan, "gw")
        kv_reader, kv_writer = await connect(wan, "kv")
        for reader, writer in ((gw_reader, gw_writer), (kv_reader, kv_writer)):
            writer.write(b"before")
            assert await read_n(reader, 6) == b"before"

        wan.cut("blackhole", ["kv"])
        kv_writer.write(b"frozen")
        gw_writer.write(b"moving")
        assert await read_n(gw_reader, 6) == b"moving"
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await kv_reader.readexactly(6)
        stats = wan.stats()
        assert stats["state"] == "partial" and stats["cut_routes"] == {"kv": "blackhole"}
        assert (stats["routes"]["gw"]["state"], stats["routes"]["kv"]["state"]) == ("up", "blackhole")
        assert (stats["routes"]["gw"]["a_to_b"]["bytes"], stats["routes"]["kv"]["a_to_b"]["bytes"]) == (12, 6)

        wan.cut("reset", ["gw"])  # the blackholed route keeps its connection and its frozen bytes
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read_n(gw_reader, 1)
        gw_writer.transport.abort()
        assert wan.cut_routes() == {"gw": "reset", "kv": "blackhole"}

        wan.restore(["kv"])  # like TCP retransmission after the outage: nothing was lost
        assert await read_n(kv_reader, 6) == b"frozen"
        assert wan.stats()["cut_routes"] == {"gw": "reset"}
        reader, writer = await connect(wan, "gw")  # still refused: only kv was restored
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read_n(reader, 1)
        writer.transport.abort()

        wan.restore()
        assert wan.state == "up" and wan.stats()["cut_routes"] == {}
        reader, writer = await connect(wan, "gw")
        writer.write(b"again")
        assert await read_n(reader, 5) == b"again"
        writer.close()
        kv_writer.close()


def test_a_cut_naming_an_unknown_route_changes_nothing() -> None:
    wan = WanEmulator(LinkConfig(), [Route("kv", "127.0.0.1", 0, "127.0.0.1", 1),
                                     Route("gw", "127.0.0.1", 0, "127.0.0.1", 2)])
    with pytest.raises(ValueError, match=r"unknown routes \['nats'\]; this emulator has \['gw', 'kv'\]"):
        wan.cut("blackhole", ["kv", "nats"])
    with pytest.raises(ValueError, match="name at least one route"):
        wan.cut("blackhole", [])
    with pytest.raises(ValueError, match="unknown routes"):
        wan.restore(["nats"])
    assert wan.state == "up" and wan.cut_routes() == {}


async def test_slow_reader_backpressures_the_sender_instead_of_buffering() -> None:
    stall = Upstream("stall")
    await stall.start()
    try:
        link = LinkConfig(bandwidth_bps=80e6, buffer_bytes=512 * 1024)
        async with WanEmulator(link, [route_to(stall)]) as wan:
            _, writer = await connect(wan)
            chunk = b"z" * (256 * 1024)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    while True:  # the sender must end up blocked, not let the emulator hoard bytes
                        writer.write(chunk)
                        await writer.drain()
            stats = wan.stats()
            assert stats["buffered_bytes"] <= 512 * 1024
            # What the stalled upstream's socket buffers took, plus our bound; far below 1.5 s at 80 Mbit/s.
            assert stats["a_to_b"]["bytes"] < 15 * MB
            writer.transport.abort()
    finally:
        await stall.stop()


async def test_bandwidth_trace_changes_the_achieved_rate(sink: Upstream) -> None:
    trace = ((0.0, 80e6), (0.6, 8e6))
    async with WanEmulator(LinkConfig(bandwidth_trace=trace, trace_period_s=60), [route_to(sink)]) as wan:
        t_epoch = time.monotonic()
        _, writer = await connect(wan)
        sender = asyncio.create_task(send_all(writer, b"t" * (20 * MB)))
        await asyncio.sleep(1.3)
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.transport.abort()
        arrivals = (await sink.connection(0)).arrivals

    def rate_bps(t_from: float, t_to: float) -> float:
        inside = [n for t, n in arrivals if t_from <= t - t_epoch <= t_to]
        return (inside[-1] - inside[0]) * 8 / (t_to - t_from)

    fast, slow = rate_bps(0.1, 0.5), rate_bps(0.8, 1.2)
    assert 40e6 < fast < 120e6, fast
    assert 3e6 < slow < 14e6, slow


def test_rate_schedule_integrates_across_trace_steps_and_loops() -> None:
    link = LinkConfig(bandwidth_trace=((0, 8e6), (1.0, 0.0), (2.0, 16e6)))  # period 3 s
    schedule = RateSchedule(link, epoch=100.0)
    assert schedule.finish_time(100.0, 4e6) == pytest.approx(100.5)
    assert schedule.finish_time(100.5, 8e6) == pytest.approx(102.25)  # 4 Mbit, outage, 4 Mbit
    assert schedule.rate_at(103.5) == 8e6  # looped
    assert RateSchedule(LinkConfig(), 0.0).finish_time(5.0, 1e12) == 5.0


def test_link_config_rejects_nonsense() -> None:
    for bad in (dict(bandwidth_bps=-1), dict(jitter_dist="pareto"), dict(bandwidth_trace=((1, 5e6),)),
                dict(bandwidth_trace=((0, 0.0),)), dict(bandwidth_trace=((0, 1e6), (2, 1e6)), trace_period_s=1)):
        with pytest.raises(ValueError):
            LinkConfig(**bad)
    with pytest.raises(ValueError):
        WanEmulator(LinkConfig(), [])
    with pytest.raises(ValueError):
        WanEmulator(LinkConfig(), [Route("kv", "127.0.0.1", 0, "127.0.0.1", 1)]).cut("up")
    with pytest.raises(ValueError):
        Route("kv", "127.0.0.1", 0, "127.0.0.1", 1, client_side="c")


def test_trace_files_load_from_csv_and_json(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("# from a 2024 capture\nt_s,mbps\n0,100\n2.5,10\n")
    (tmp_path / "t.json").write_text(json.dumps([[0, 1e8], {"t_s": 2.5, "bps": 1e7}]))
    expected = ((0.0, 100e6), (2.5, 10e6))
    assert load_trace(tmp_path / "t.csv") == expected
    assert load_trace(tmp_path / "t.json") == expected
    (tmp_path / "raw.csv").write_text("0,5e6\n1,1e6\n")
    assert load_trace(tmp_path / "raw.csv") == ((0.0, 5e6), (1.0, 1e6))


def test_route_flags_and_link_updates_parse() -> None:
    assert parse_route("kv=127.0.0.1:9000->10.0.0.2:9100") == Route("kv", "127.0.0.1", 9000, "10.0.0.2", 9100)
    assert parse_route("nats@b=0.0.0.0:7222->127.0.0.1:7223").client_side == "b"
    assert parse_route("x=9001->[::1]:80") == Route("x", "127.0.0.1", 9001, "::1", 80)
    link = link_from_json(LinkConfig(delay_ms=15), {"bandwidth_mbps": 50, "bandwidth_trace": [[0, 1e6]]})
    assert link == LinkConfig(bandwidth_bps=50e6, delay_ms=15, bandwidth_trace=((0.0, 1e6),))
    with pytest.raises(ValueError):
        link_from_json(link, {"bandwith_bps": 1})


async def test_entry_point_serves_control_api_and_exits_cleanly_on_sigterm(echo: Upstream) -> None:
    echo_port = route_to(echo).upstream_port
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "wan", "--route", f"kv=127.0.0.1:0->127.0.0.1:{echo_port}",
        "--delay-ms", "5", "--bandwidth-mbps", "100", "--control-port", "0", "--log-level", "WARNING",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(DEADLINE_S):
            banner = (await proc.stdout.readline()).decode()
        kv_port = int(re.search(r"kv=127\.0\.0\.1:(\d+)->", banner).group(1))  # type: ignore[union-attr]
        control = re.search(r"control=(http://\S+)", banner).group(1)  # type: ignore[union-attr]

        async with asyncio.timeout(DEADLINE_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", kv_port)
        writer.write(b"through")
        assert await read_n(reader, 7) == b"through"
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(f"{control}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"{control}/stats") as resp:
                stats = await resp.json()
            assert stats["a_to_b"]["bytes"] == 7 and stats["b_to_a"]["bytes"] == 7
            assert stats["link"]["bandwidth_bps"] == 100e6
            async with http.post(f"{control}/cut", params={"mode": "blackhole", "routes": "kv"}) as resp:
                assert await resp.json() == {"state": "blackhole", "cut_routes": {"kv": "blackhole"}}
            async with http.post(f"{control}/cut", params={"mode": "reset", "routes": "kv,nats"}) as resp:
                assert resp.status == 400 and "unknown routes ['nats']" in (await resp.json())["error"]
            async with http.post(f"{control}/cut", params={"mode": "reset"}) as resp:
                assert (await resp.json())["state"] == LinkState.RESET.value
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await read_n(reader, 1)
            writer.transport.abort()
            async with http.post(f"{control}/restore", params={"routes": "kv"}) as resp:
                assert await resp.json() == {"state": "up", "cut_routes": {}}
            async with http.post(f"{control}/link", json={"bandwidth_mbps": 20, "delay_ms": 1}) as resp:
                assert resp.status == 200 and (await resp.json())["bandwidth_bps"] == 20e6
            async with http.post(f"{control}/link", json={"delay_ms": -3}) as resp:
                assert resp.status == 400
            async with http.post(f"{control}/cut", params={"mode": "sideways"}) as resp:
                assert resp.status == 400
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(DEADLINE_S):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
