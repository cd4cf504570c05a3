"""WAN faults on a real two-datacenter stack (tiny model): the NATS gateway link alone, or the whole
WAN, cut while requests are in flight.

Every in-flight request ends within its deadline, and under the gateway's default `recover`
policy it completes, token-exact: RLD finishes it when MD is cut off before the cut-over, and a
request MD was decoding migrates to RLD. After the restore the stack heals (/healthz sees every
role, a new P-RLD-MD and a new P-MD request are token-exact, the handoff crosses again) and no
tier, nor the gateway, holds any request state. How each request was recovered, and how long the
cleanup took, is printed on `WAN-FAULT` lines (`pytest -s` shows them).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import pytest
from nats.aio.msg import Msg

from shared import bus
from tools.api_client import ApiError, StreamResult, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import MD_KV_ROUTE, NATS_GW_A_ROUTE, NATS_GW_B_ROUTE

from helpers import fresh_heartbeats, random_prompt

Generate = Callable[[list[int], int], list[int]]

BEAT = ["--heartbeat-s", "0.25"]  # the gateway sees an instance gone after 3.5 beats
TOKEN_TIMEOUT_S = 20.0  # the gateway's next-token deadline: the longest a client waits for a token
REQUEST_TIMEOUT_S = 15.0  # a request's whole deadline, on the gateway and on every tier it reaches
KV_STALL_TIMEOUT_S = 2.0
BASE_LINK = {"bandwidth_mbps": 200.0, "delay_ms": 5.0, "jitter_ms": 0.0}
NATS_LINK = (NATS_GW_A_ROUTE, NATS_GW_B_ROUTE)  # the NATS supercluster link, both directions
WHOLE_WAN = None  # every route: the NATS link and MD's KV
TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32
PROMPT_TOKENS = 80
HANDOFF_AT, HANDOFF_MAX_TOKENS = 100, 130
SETTLE_S = TOKEN_TIMEOUT_S + 15  # a request still open this long after the cut hangs
HEAL_TIMEOUT_S = 30.0
CLEAN_TIMEOUT_S = 5.0  # after the heal; an Abort the cut link lost comes again with MD's next heartbeat,
# well before the request deadline (REQUEST_TIMEOUT_S after the cut) would free it


STALL = ["--kv-stall-timeout-s", str(KV_STALL_TIMEOUT_S)]
STACK = {"topology": "two-dc", "wan_bandwidth_mbps": BASE_LINK["bandwidth_mbps"], "wan_delay_ms": BASE_LINK["delay_ms"],
         "wan_jitter_ms": BASE_LINK["jitter_ms"],
         "extra_args": {"prefill": [*BEAT, *STALL], "relay": BEAT, "main": [*BEAT, *STALL],
                        "gateway": [*BEAT, "--token-timeout-s", str(TOKEN_TIMEOUT_S),
                                    "--request-timeout-s", str(REQUEST_TIMEOUT_S)]}}


@pytest.fixture
async def wan(stack: LocalStack) -> AsyncIterator[LocalStack]:
    """The shared stack with every route up; put back up, and the test's requests cancelled, even
    if the test failed half-way."""
    await stack.wan.restore()
    yield stack
    for task in IN_FLIGHT:
        task.cancel()
    await asyncio.gather(*IN_FLIGHT, return_exceptions=True)
    await stack.wan.restore()


IN_FLIGHT: set[asyncio.Task[StreamResult]] = set()  # the requests of the running test, owned by `wan`


class InFlight:
    """One streamed request in a task of its own, so the test can cut the link while it runs."""

    def __init__(self, session: aiohttp.ClientSession, stack: LocalStack, name: str, prompt_ids: list[int],
                 max_tokens: int, **pdd: object) -> None:
        self.name = name
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.tokens_seen = 0
        self.ended_at: float | None = None  # monotonic; when the stream closed, either way
        self._progress = asyncio.Event()
        body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "pdd": pdd}
        self.task = asyncio.create_task(self._run(session, stack.api_url, body), name=f"request-{name}")
        IN_FLIGHT.add(self.task)
        self.task.add_done_callback(IN_FLIGHT.discard)

    async def _run(self, session: aiohttp.ClientSession, api_url: str, body: dict[str, object]) -> StreamResult:
        try:
            return await stream_completion(session, api_url, body, on_token=self._on_token)
        finally:
            self.ended_at = time.monotonic()
            self._progress.set()  # wakes wait_tokens, which then sees the task done

    def _on_token(self, index: int, tier: str) -> None:
        self.tokens_seen = index + 1
        self._progress.set()

    async def wait_tokens(self, count: int, timeout_s: float = 15.0) -> None:
        """Until the client has `count` tokens, the request still running."""
        async with asyncio.timeout(timeout_s):
            while self.tokens_seen < count:
                assert not self.task.done(), f"{self.name} ended with {self.tokens_seen} tokens: {self.task}"
                self._progress.clear()
                await self._progress.wait()


@dataclass(frozen=True)
class Outcome:
    request: InFlight
    result: StreamResult | None  # None: it ended with an API error
    ended_after_cut_s: float
    detail: str  # the recovery taken (or None) and the tiers when complete; the error when not


async def settle(request: InFlight, cut_at: float) -> Outcome:
    """The request's end, complete or an API error, within its deadline; never a hang."""
    try:
        async with asyncio.timeout(SETTLE_S):
            result: StreamResult | None = await request.task
    except ApiError as exc:
        result, detail = None, str(exc)
    except TimeoutError:
        pytest.fail(f"{request.name}: still open {SETTLE_S:.0f} s after the cut, with "
                    f"{request.tokens_seen} of {request.max_tokens} tokens")
    else:
        assert result is not None and result.finish_reason == "length", request.name
        tiers = {tier: result.tiers.count(tier) for tier in dict.fromkeys(result.tiers)}
        detail = f"recovery={result.summary.get('recovery')} tiers={tiers}"
    assert request.ended_at is not None
    outcome = Outcome(request, result, request.ended_at - cut_at, detail)
    print(f"\nWAN-FAULT {request.name}: {'complete' if result else 'error'} "
          f"{outcome.ended_after_cut_s:.2f} s after the cut: {detail}", flush=True)
    assert outcome.ended_after_cut_s < TOKEN_TIMEOUT_S + 5, outcome
    return outcome


def assert_recovered_token_exact(outcomes: Sequence[Outcome], generate: Generate) -> None:
    """Checked last: the reference `generate` of a few hundred tokens takes seconds on a busy CPU,
    which must not delay the restore."""
    for outcome in outcomes:
        assert outcome.result is not None, f"{outcome.request.name}: not recovered: {outcome.detail}"
        request = outcome.request
        assert outcome.result.token_ids == generate(request.prompt_ids, request.max_tokens), \
            f"{request.name}: complete but not token-exact"


async def cut(stack: LocalStack, mode: str, routes: Sequence[str] | None) -> float:
    reply = await stack.wan.cut(mode, routes)
    cut_routes = set(routes or (MD_KV_ROUTE, *NATS_LINK))
    assert reply["cut_routes"] == {name: mode for name in cut_routes}, reply
    return time.monotonic()


async def main_unseen(session: aiohttp.ClientSession, stack: LocalStack) -> None:
    """The gateway noticed that MD's heartbeats stopped crossing (the cut was felt)."""
    async with asyncio.timeout(10):
        while True:
            async with session.get(stack.api_url + "/healthz") as resp:
                if resp.status == 503 and (await resp.json())["instances"]["main"] == 0:
                    return
            await asyncio.sleep(0.1)


async def nats_carries(from_url: str, to_url: str, timeout_s: float = HEAL_TIMEOUT_S) -> None:
    """A message published in one datacenter reaches a subscriber in the other."""
    subject = f"test.wan-faults.{uuid.uuid4().hex}"
    sender, receiver = await bus.connect(from_url, "test-wan-probe-tx"), await bus.connect(to_url, "test-wan-probe-rx")
    arrived = asyncio.Event()

    async def on_probe(msg: Msg) -> None:
        arrived.set()

    try:
        await receiver.subscribe(subject, cb=on_probe)
        await receiver.flush()
        async with asyncio.timeout(timeout_s):
            while not arrived.is_set():
                await sender.publish(subject, b"probe")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await arrived.wait()
    finally:
        await sender.close()
        await receiver.close()


async def heal(session: aiohttp.ClientSession, stack: LocalStack, generate: Generate, seed: int) -> None:
    """Restore the link; the stack serves both pipelines across it again, token-exact."""
    restored_at = time.monotonic()
    assert (await stack.wan.restore())["cut_routes"] == {}
    await stack.wait_healthy(HEAL_TIMEOUT_S)  # B -> A: MD's heartbeats cross again
    healthy_s = time.monotonic() - restored_at
    # A -> B as well: /healthz cannot tell, and after a reset each nats-server redials its own
    # direction on its own retry timer (up to ~1 s apart); until then MD gets no assign.
    await nats_carries(stack.nats_url, stack.nats_url_b)
    a_to_b_s = time.monotonic() - restored_at
    await serves_both_pipelines(session, stack, generate, seed)
    print(f"WAN-FAULT healed: /healthz ok {healthy_s:.2f} s after the restore, NATS A -> B {a_to_b_s:.2f} s, "
          f"both pipelines token-exact {time.monotonic() - restored_at:.2f} s", flush=True)


async def serves_both_pipelines(session: aiohttp.ClientSession, stack: LocalStack, generate: Generate,
                                seed: int) -> None:
    """A P-RLD-MD request (its handoff crossing A -> B) and a P-MD one are token-exact."""
    for offset, pdd, tiers in ((0, {"pipeline": "p-rld-md", "handoff_at": 4}, ["relay"] * 4 + ["main"] * 20),
                               (1, {"pipeline": "p-md"}, ["main"] * 24)):
        prompt = random_prompt(seed + offset, PROMPT_TOKENS)
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "pdd": pdd}
        async with asyncio.timeout(HEAL_TIMEOUT_S):
            result = await stream_completion(session, stack.api_url, body)
        assert result.token_ids == generate(prompt, 24), pdd
        assert result.tiers == tiers, pdd


async def gateway_running(session: aiohttp.ClientSession, stack: LocalStack) -> float:
    async with session.get(stack.api_url + "/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("pdd_running_requests "))


async def leftovers(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, float]:
    """Request state still held anywhere: each tier's fresh heartbeat (MD's read in B), the gateway's gauge."""
    beats = {**await fresh_heartbeats(stack.nats_url, ("prefill", "relay")),
             **await fresh_heartbeats(stack.nats_url_b, ("main",))}
    held = {"gateway.running": await gateway_running(session, stack)}
    for role, beat in beats.items():
        held[f"{role}.running"] = beat.running
        for gauge in ("open_inboxes", "open_transfers", "locked_nodes"):
            held[f"{role}.{gauge}"] = beat.stats.get(gauge, 0)
    return {name: value for name, value in held.items() if value}


async def nothing_left_behind(session: aiohttp.ClientSession, stack: LocalStack, cut_at: float) -> None:
    deadline = time.monotonic() + CLEAN_TIMEOUT_S
    first_held = held = await leftovers(session, stack)
    while held:
        if time.monotonic() > deadline:
            pytest.fail(f"request state left behind {CLEAN_TIMEOUT_S:.0f} s after the heal: {held}")
        await asyncio.sleep(0.5)
        held = await leftovers(session, stack)
    print(f"WAN-FAULT clean {time.monotonic() - cut_at:.2f} s after the cut"
          f"{f' (held after the heal: {first_held})' if first_held else ''}", flush=True)


async def wait_kv_crossed(stack: LocalStack, before: int, kv_bytes: int, request: InFlight) -> None:
    """MD holds the prompt's whole KV: its bytes have crossed the md_kv route."""
    async with asyncio.timeout(15):
        while (await stack.wan.stats())["routes"][MD_KV_ROUTE]["a_to_b"]["bytes"] - before < kv_bytes:
            assert not request.task.done(), request.task
            await asyncio.sleep(0.02)


# --- the NATS supercluster link alone -------------------------------------------------------------

@pytest.mark.timeout(150 + 2 * SETTLE_S + HEAL_TIMEOUT_S + CLEAN_TIMEOUT_S)
@pytest.mark.parametrize("mode", ["blackhole", "reset"])
async def test_a_cut_nats_link_ends_each_request_and_the_stack_heals(
        wan: LocalStack, session: aiohttp.ClientSession, tiny_generate: Generate, mode: str) -> None:
    seed = {"blackhole": 100, "reset": 200}[mode]
    # P-RLD-MD before its cut: RLD streams, MD still waits for its (held back) KV
    before_cut = InFlight(session, wan, f"nats-{mode} p-rld-md before the cut", random_prompt(seed, PROMPT_TOKENS),
                          40, pipeline="p-rld-md", handoff_at=10, md_kv_delay_ms=3000)
    # P-MD while MD decodes
    decoding = InFlight(session, wan, f"nats-{mode} p-md decoding", random_prompt(seed + 1, PROMPT_TOKENS),
                        200, pipeline="p-md")
    await asyncio.gather(before_cut.wait_tokens(5), decoding.wait_tokens(20))
    cut_at = await cut(wan, mode, NATS_LINK)
    stats = await wan.wan.stats()
    assert stats["state"] == "partial" and stats["routes"][MD_KV_ROUTE]["state"] == "up"

    outcomes = [await settle(before_cut, cut_at), await settle(decoding, cut_at)]
    await main_unseen(session, wan)
    await heal(session, wan, tiny_generate, seed + 2)
    await nothing_left_behind(session, wan, cut_at)
    assert_recovered_token_exact(outcomes, tiny_generate)


# --- a cut while RLD hands the request to MD ------------------------------------------------------

@pytest.mark.timeout(150 + SETTLE_S + HEAL_TIMEOUT_S + CLEAN_TIMEOUT_S)
@pytest.mark.parametrize(("handoff_mode", "mode", "routes"), [
    ("catch-up", "blackhole", WHOLE_WAN),
    ("catch-up", "reset", NATS_LINK),
    ("one-shot", "reset", WHOLE_WAN),
    ("one-shot", "blackhole", NATS_LINK),
], ids=["catch-up-wan-blackhole", "catch-up-nats-reset", "one-shot-wan-reset", "one-shot-nats-blackhole"])
async def test_a_cut_during_the_handoff_ends_the_request_and_the_stack_heals(
        wan: LocalStack, session: aiohttp.ClientSession, tiny_generate: Generate, handoff_mode: str, mode: str,
        routes: tuple[str, ...] | None) -> None:
    seed = 300 + 10 * ["catch-up", "one-shot"].index(handoff_mode) + ["blackhole", "reset"].index(mode)
    where = "wan" if routes is WHOLE_WAN else "nats"
    prompt = random_prompt(seed, PROMPT_TOKENS)
    kv_before = (await wan.wan.stats())["routes"][MD_KV_ROUTE]["a_to_b"]["bytes"]
    # handoff_at pins RLD's cut late, so the handoff (MD reporting, RLD sending chunks in Catch-Up)
    # lasts ~0.6 s of RLD decoding on this machine; the WAN is cut in the middle of it
    request = InFlight(session, wan, f"{where}-{mode} p-rld-md {handoff_mode} handoff", prompt, HANDOFF_MAX_TOKENS,
                       pipeline="p-rld-md", handoff_at=HANDOFF_AT, handoff_mode=handoff_mode)
    await wait_kv_crossed(wan, kv_before, (len(prompt) - 1) * TINY_KV_BYTES_PER_TOKEN, request)
    await request.wait_tokens(20)
    assert request.tokens_seen < HANDOFF_AT, "the WAN must be cut during the handoff, not after it"
    cut_at = await cut(wan, mode, routes)

    outcome = await settle(request, cut_at)
    await main_unseen(session, wan)
    await heal(session, wan, tiny_generate, seed + 1000)
    await nothing_left_behind(session, wan, cut_at)
    assert_recovered_token_exact([outcome], tiny_generate)
