"""Two datacenters on one machine: P, RLD and the gateway in A, MD in B, each side with its own
nats-server, joined by a NATS gateway, and the WAN emulator as the only way between them.

One two-dc stack on the tiny model serves most of the module; each test shapes the link it needs
through the emulator's control API. A second stack runs P in float32 and the decoders in bfloat16.
Timing bounds are loose on purpose: the machine may have two shared cores.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import DynamicCache

from shared import bus, messages, subjects
from shared.cpu_linears import adapt_linears
from shared.model_runner import ATTENTION
from shared.models import load_model
from tools.api_client import ApiError
from tools.cli import build_parser
from tools.launcher import LocalStack
from tools.stack_config import (
    MD_KV_ROUTE,
    NATS,
    NATS_B,
    NATS_GW_A_ROUTE,
    NATS_GW_B_ROUTE,
    SERVICES,
    WAN,
    StackConfig,
    StackError,
)
from wan.emulator import WanStats

from conftest import reference_generate
from helpers import RESTART_TIMEOUT_S, complete, process_alive, stack_config

STARTUP_TIMEOUT_S = 150.0
CHUNK_TOKENS = 64
KV_STALL_TIMEOUT_S = 2.0
TOKEN_TIMEOUT_S = 10.0  # the gateway's next-token deadline: what a client waits at most
TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32
# What each test starts from: a fast line with a little delay, so every test sees a real WAN.
BASE_LINK = {"bandwidth_mbps": 200.0, "delay_ms": 5.0, "jitter_ms": 0.0}
Generate = Callable[[list[int], int], list[int]]


STACK: dict[str, object] = {
    "chunk_tokens": CHUNK_TOKENS, "startup_timeout_s": STARTUP_TIMEOUT_S, "topology": "two-dc", "wan_jitter_ms": 0.0,
    "wan_bandwidth_mbps": BASE_LINK["bandwidth_mbps"], "wan_delay_ms": BASE_LINK["delay_ms"],
    "extra_args": {"prefill": ["--kv-stall-timeout-s", str(KV_STALL_TIMEOUT_S)],
                   "main": ["--kv-stall-timeout-s", str(KV_STALL_TIMEOUT_S)],
                   "gateway": ["--token-timeout-s", str(TOKEN_TIMEOUT_S)]}}


def two_dc_config(log_dir: Path, **overrides: object) -> StackConfig:
    return stack_config(log_dir, **{**STACK, **overrides})


@pytest.fixture
async def wan(stack: LocalStack) -> AsyncIterator[LocalStack]:
    """The shared stack with the link at BASE_LINK; put back up and to BASE_LINK after the test."""
    await stack.wan.set_link(**BASE_LINK)
    yield stack
    await stack.wan.restore()
    await stack.wan.set_link(**BASE_LINK)


def random_prompt(seed: int, tokens: int) -> list[int]:
    """A prompt no other test sends, so neither P's cache nor MD's DRC holds any of it."""
    rng = random.Random(seed)
    return [rng.randrange(3, 49_000) for _ in range(tokens)]


def route_bytes(stats: WanStats, route: str, direction: str) -> int:
    return stats["routes"][route][direction]["bytes"]  # type: ignore[literal-required]


async def heartbeat_stats(nats_url: str, after: float, timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """Each role's heartbeat `stats`, from beats sent after `after` (wall clock), seen from A."""
    nc = await bus.connect(nats_url, "test-two-dc-heartbeats")
    seen: dict[str, dict[str, float]] = {}

    async def on_beat(msg) -> None:
        beat = messages.decode(msg.data)
        if beat.sent_at > after:
            seen[beat.role] = beat.stats

    try:
        await nc.subscribe(subjects.heartbeat_all(), cb=on_beat)
        async with asyncio.timeout(timeout_s):
            while set(seen) != {"prefill", "relay", "main"}:
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return seen


async def wait_until_clean(stack: LocalStack) -> dict[str, dict[str, float]]:
    """Heartbeats that show no KV inbox, transfer or DRC lock left behind (cleanup may take a beat)."""
    deadline = time.monotonic() + 15
    while True:
        beats = await heartbeat_stats(stack.nats_url, time.time())
        left = {"prefill": beats["prefill"]["open_transfers"] + beats["prefill"]["locked_nodes"],
                "relay": beats["relay"]["open_inboxes"],
                "main": beats["main"]["open_inboxes"] + beats["main"]["locked_nodes"]}
        if not any(left.values()) or time.monotonic() > deadline:
            return beats
        await asyncio.sleep(0.5)


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["up", "demo"])
def test_topology_and_wan_flags_reach_the_stack_config(command: str) -> None:
    args = build_parser().parse_args([command, "--topology", "two-dc", "--wan-bandwidth-mbps", "20",
                                      "--wan-delay-ms", "15", "--wan-jitter-ms", "2", "--wan-trace", "t.csv",
                                      "--wan-control-port", "8081"])
    config = StackConfig.from_namespace(args)
    assert (config.topology, config.wan_bandwidth_mbps, config.wan_delay_ms, config.wan_jitter_ms) == \
        ("two-dc", 20.0, 15.0, 2.0)
    assert config.wan_trace == Path("t.csv") and config.wan_control_port == 8081
    assert StackConfig.from_namespace(build_parser().parse_args([command])).topology == "one-dc"


def test_placement_flags_put_the_gateway_in_b_and_pin_processes_to_cores() -> None:
    config = StackConfig.from_namespace(build_parser().parse_args([
        "up", "--topology", "two-dc", "--gateway-dc", "b", "--cpus", "prefill=0", "--cpus", "relay,main=1-2,4",
        "--cpus", "prefill=3"]))
    assert [config.datacenter_of(p) for p in ("gateway", "prefill", "relay", "main")] == ["b", "a", "a", "b"]
    assert dict(config.cpu_affinity) == {"prefill": (3,), "relay": (1, 2, 4), "main": (1, 2, 4)}, "the last flag wins"
    default = StackConfig.from_namespace(build_parser().parse_args(["up"]))
    assert default.datacenter_of("gateway") == "a" and not default.cpu_affinity
    for bad in (["--gateway-dc", "c"], ["--cpus", "prefill"], ["--cpus", "prefill=1-0"], ["--cpus", "router=0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *bad])
    with pytest.raises(ValueError, match="gateway_datacenter"):
        StackConfig(gateway_datacenter="c")
    with pytest.raises(ValueError, match="no core"):
        StackConfig(cpu_affinity={"prefill": ()})


async def test_cores_the_machine_lacks_are_refused_before_anything_starts(tmp_path: Path) -> None:
    missing_core = os.cpu_count() or 1
    stack = LocalStack(two_dc_config(tmp_path / "logs", cpu_affinity={"main": (missing_core,)}))
    with pytest.raises(StackError, match="--cpus main"):
        await stack.start()
    assert not stack.processes


def test_an_unknown_topology_is_refused() -> None:
    with pytest.raises(ValueError, match="topology"):
        StackConfig(topology="three-dc")


@pytest.mark.timeout(60)
async def test_an_emulator_that_cannot_start_fails_the_start_with_its_log_tail(tmp_path: Path) -> None:
    stack = LocalStack(two_dc_config(tmp_path / "logs", wan_trace=tmp_path / "no-such-trace.csv"))
    with pytest.raises(StackError, match=r"(?s)wan exited with code 2.*no-such-trace"):
        await stack.start()
    assert set(stack.processes) == {WAN}, "nothing starts after the emulator failed"
    assert all(proc.returncode is not None for proc in stack.processes.values())


# --- one two-dc stack ---------------------------------------------------------------------------

@pytest.mark.timeout(STARTUP_TIMEOUT_S + 30)
async def test_two_dc_stack_runs_a_nats_server_per_datacenter_and_the_emulator(stack: LocalStack) -> None:
    assert set(stack.processes) == {NATS, NATS_B, WAN, *SERVICES}
    assert all(proc.poll() is None for proc in stack.processes.values())
    assert stack.nats_url != stack.nats_url_b
    stats = await stack.wan.stats()
    assert stats["state"] == "up"
    assert set(stats["routes"]) == {MD_KV_ROUTE, NATS_GW_A_ROUTE, NATS_GW_B_ROUTE}
    # MD's heartbeats reach the gateway (healthy) only across the NATS gateway, one link each way
    assert stats["routes"][NATS_GW_A_ROUTE]["connections_open"] >= 1
    assert stats["routes"][NATS_GW_B_ROUTE]["connections_open"] >= 1
    assert route_bytes(stats, NATS_GW_B_ROUTE, "b_to_a") > 0


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_cross_datacenter_request_is_token_exact_and_its_kv_crosses_the_wan(
        wan: LocalStack, session: aiohttp.ClientSession, tiny_generate: Generate, pipeline: str) -> None:
    await wan.wan.set_link(bandwidth_mbps=20, delay_ms=20)  # slow enough that RLD makes the first tokens
    prompt = random_prompt({"p-md": 1, "p-rld-md": 2}[pipeline], 200)
    handoff = {"handoff_at": 4} if pipeline == "p-rld-md" else {}
    before = await wan.wan.stats()
    result = await complete(session, wan, prompt, 32, pipeline=pipeline, **handoff)
    after = await wan.wan.stats()

    assert result.token_ids == tiny_generate(prompt, 32)
    if pipeline == "p-md":
        assert set(result.tiers) == {"main"}
    else:
        assert result.tiers == ["relay"] * 4 + ["main"] * 28  # KVReady went B -> A, Handoff A -> B
    main_kv_bytes = result.summary["kv"]["main"]["kv_bytes"]
    assert main_kv_bytes >= (len(prompt) - 1) * TINY_KV_BYTES_PER_TOKEN
    kv_crossed = route_bytes(after, MD_KV_ROUTE, "a_to_b") - route_bytes(before, MD_KV_ROUTE, "a_to_b")
    assert main_kv_bytes <= kv_crossed <= main_kv_bytes + 4096  # MD's KV, plus at most a handshake; not RLD's
    for route, direction in ((NATS_GW_A_ROUTE, "a_to_b"), (NATS_GW_B_ROUTE, "b_to_a")):
        assert route_bytes(after, route, direction) > route_bytes(before, route, direction), route


async def test_a_catch_up_streamed_from_rlds_first_token_over_the_wan_is_token_exact(
        wan: LocalStack, session: aiohttp.ClientSession, tiny_generate: Generate) -> None:
    """Catch-Up over a 20 ms link: RLD streams each token while MD's KV crosses; MD recomputes what
    came, reports once, recomputes on until RLD announces its cut, then collects for the cut's pass
    (services/main/takeover.py). Whichever of those the tokens went through, each is fed once, in
    order: the answer is the reference's, RLD's part first."""
    await wan.wan.set_link(bandwidth_mbps=20, delay_ms=20)
    prompt = random_prompt(7, 200)
    result = await complete(session, wan, prompt, 400, pipeline="p-rld-md", handoff_mode="catch-up")

    assert result.token_ids == tiny_generate(prompt, 400)
    assert result.handoff is not None and result.handoff["mode"] == "catch-up", result.handoff
    assert result.handoff["chunks"] >= 2, "RLD streamed its tokens as they came, not once at its cut"
    cut = result.tiers.index("main")
    assert result.tiers == ["relay"] * cut + ["main"] * (400 - cut)


async def test_kv_transfer_takes_the_time_the_link_arithmetic_says(
        wan: LocalStack, session: aiohttp.ClientSession) -> None:
    measured: dict[tuple[float, float], tuple[float, float]] = {}
    for seed, (mbps, delay_ms) in enumerate([(20.0, 20.0), (5.0, 50.0)]):
        await wan.wan.set_link(bandwidth_mbps=mbps, delay_ms=delay_ms)
        # 600 tokens: 0.6 MB, enough line time that P's compute and NATS hops are small beside it
        result = await complete(session, wan, random_prompt(100 + seed, 600), 2, pipeline="p-md")
        kv = result.summary["kv"]["main"]
        # MD starts its clock at the DecodeAssign; its reply crosses back before P starts sending,
        # and the first KV byte crosses again: two one-way delays, plus the bytes at line rate.
        expected_s = kv["kv_bytes"] * 8 / (mbps * 1e6) + 2 * delay_ms / 1000
        measured[(mbps, delay_ms)] = (kv["kv_wait_s"], expected_s)
        assert 0.5 * expected_s <= kv["kv_wait_s"] <= 3 * expected_s, measured
    # a quarter of the bandwidth and more delay (3.8x the arithmetic): clearly slower, whatever the overheads
    assert measured[(5.0, 50.0)][0] > 1.5 * measured[(20.0, 20.0)][0], measured


async def test_the_policy_predicts_with_the_rate_md_saw_the_kv_arrive_at(
        wan: LocalStack, session: aiohttp.ClientSession) -> None:
    """P's KV writes complete into buffers (its kernel's alone hold megabytes on loopback), so the
    rate P sees is not the line's; MD times the KV as it arrives, and the next request's prediction
    (`pdd.policy.link_bytes_per_s`) uses that: 20 Mbit/s here, within the machine's noise."""
    await wan.wan.set_link(bandwidth_mbps=20.0, delay_ms=20.0)
    first = await complete(session, wan, random_prompt(200, 1500), 2, pipeline="p-md")  # 1.5 MB cross
    second = await complete(session, wan, random_prompt(201, 1500), 2, pipeline="p-md")
    line = 20e6 / 8
    seen = [r.summary["policy"]["link_bytes_per_s"] for r in (first, second)]
    assert 0.5 * line <= seen[1] <= 1.5 * line, [s and s / line for s in seen]


# What the client hears when the link is cut mid-transfer under the `fail` policy. Nothing from B crosses a cut link, so
# MD's own stall error never arrives; the request fails in A: by P if it still had KV to write (its
# write stalls, or its connection is reset), else by the gateway's watchdog once MD's heartbeats
# stop arriving, at the latest by the next-token deadline. Which one is timing: P's kernel send
# buffer alone holds ~4 MB on loopback, more than the tiny model's whole KV.
IN_A = ("stopped answering", "no token came within")
CUT_ERRORS = {
    "blackhole": ("KV link stalled", *IN_A),
    "reset": ("Connection reset", *IN_A),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "policy"), [("blackhole", "recover"), ("reset", "recover"), ("blackhole", "fail"),
                                              ("reset", "fail")])
async def test_a_link_cut_mid_transfer_moves_or_fails_the_request_and_the_stack_recovers(
        wan: LocalStack, session: aiohttp.ClientSession, tiny_generate: Generate, mode: str, policy: str) -> None:
    """Under `recover` the request migrates (to RLD alone: no MD is reachable) and completes,
    token-exact; under `fail` it fails clearly, within its deadline."""
    await wan.wan.set_link(bandwidth_mbps=2, delay_ms=5)  # ~1.5 MB of KV takes ~6 s: time to cut it
    prompt = random_prompt(200 + len(mode) + 10 * len(policy), 1500)  # uncached: P computes it chunk by chunk
    md_stalls_before = wan.log_paths["main"].read_text().count("stalled: no frame")
    before = route_bytes(await wan.wan.stats(), MD_KV_ROUTE, "a_to_b")
    request = asyncio.create_task(complete(session, wan, prompt, 8, pipeline="p-md", failure_policy=policy))
    async with asyncio.timeout(30):
        while route_bytes(await wan.wan.stats(), MD_KV_ROUTE, "a_to_b") - before < 128 * 1024:
            assert not request.done(), "the KV transfer must still be running when the link is cut"
            await asyncio.sleep(0.05)
    await wan.wan.cut(mode)
    cut_at = time.monotonic()
    if policy == "recover":
        async with asyncio.timeout(TOKEN_TIMEOUT_S + 15):
            result = await request
        assert result.token_ids == tiny_generate(prompt, 8)
        migration, = result.summary["migrations"]
        assert migration["after_tokens"] == 0 and migration["pipeline"] == "p-rld", migration
        assert time.monotonic() - cut_at < TOKEN_TIMEOUT_S + 5
    else:
        with pytest.raises(ApiError) as failed:
            async with asyncio.timeout(TOKEN_TIMEOUT_S + 15):
                await request
        failed_after_s = time.monotonic() - cut_at
        assert any(error in str(failed.value) for error in CUT_ERRORS[mode]), str(failed.value)
        assert failed_after_s < TOKEN_TIMEOUT_S + 5, (failed_after_s, str(failed.value))
    async with asyncio.timeout(10):  # MD gave up on its side too, although nobody could hear it
        while wan.log_paths["main"].read_text().count("stalled: no frame") == md_stalls_before:
            await asyncio.sleep(0.1)

    await wan.wan.restore()
    await wan.wan.set_link(**BASE_LINK)
    await wan.wait_healthy(60)  # MD's heartbeats cross again (after a reset, once NATS redialled)
    again = random_prompt(300 + len(mode), 100)
    result = await complete(session, wan, again, 16, pipeline="p-md")
    assert result.token_ids == tiny_generate(again, 16)

    beats = await wait_until_clean(wan)
    assert beats["prefill"]["open_transfers"] == 0, beats
    assert beats["prefill"]["locked_nodes"] == 0, beats
    assert beats["relay"]["open_inboxes"] == 0, beats
    assert beats["main"]["open_inboxes"] == 0, beats
    assert beats["main"]["locked_nodes"] == 0, beats


@pytest.mark.timeout(60)
async def test_stop_leaves_no_process_of_the_two_dc_stack(stack: LocalStack) -> None:
    pids = {role: proc.pid for role, proc in stack.processes.items()}
    await stack.stop()
    assert all(proc.returncode is not None for proc in stack.processes.values())
    assert not [role for role, pid in pids.items() if process_alive(pid)]
    assert not stack.state_path.exists()


# --- P in float32, decoders in bfloat16 (last: the stack above is stopped by now) ---------------

MIXED_PROMPT_LENGTHS = (6, 41, 131, 301)
MIXED_TOKENS = 32


def fp32_prefill_bf16_decode(model_path: Path) -> Generate:
    """What a float32 P and a bfloat16 MD compute together, on one node: the prompt's KV in
    float32, chunk by chunk as P does; rounded to bfloat16 (on the wire or at MD); then greedy
    decoding in bfloat16 from the last prompt token."""
    fp32, bf16 = load_model(model_path, "float32", "cpu"), load_model(model_path, "bfloat16", "cpu")
    bf16.set_attn_implementation(ATTENTION)  # a decoder's arithmetic: one query token attends in float32
    adapt_linears(bf16)  # and its linears, packed and planned as this CPU's oneDNN needs (shared/cpu_linears.py)

    @torch.inference_mode()
    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        cache = DynamicCache(config=fp32.config)
        kv_ids = prompt_ids[:-1]
        for start in range(0, len(kv_ids), CHUNK_TOKENS):
            fp32(input_ids=torch.tensor([kv_ids[start:start + CHUNK_TOKENS]]), cache=cache, use_cache=True)
        rounded = DynamicCache(config=bf16.config)
        for index, layer in enumerate(cache.layers):
            rounded.update(layer.keys.to(torch.bfloat16), layer.values.to(torch.bfloat16), index)
        out, feed = [], prompt_ids[-1]
        for _ in range(max_new_tokens):
            logits = bf16(input_ids=torch.tensor([[feed]]), cache=rounded, use_cache=True).logits
            feed = int(logits[0, -1].argmax())
            out.append(feed)
        return out

    return generate


@pytest.fixture(scope="module")
async def mixed_stack(tmp_path_factory: pytest.TempPathFactory, stack: LocalStack) -> AsyncIterator[LocalStack]:
    await stack.stop()  # if still running: two stacks of model processes are too many for a small machine
    bf16 = ["--dtype", "bfloat16"]
    # This stack also runs the other placement: the gateway beside MD in B, and P pinned to one core.
    config = two_dc_config(tmp_path_factory.mktemp("two-dc-mixed"), dtype="float32", wan_bandwidth_mbps=0.0,
                           extra_args={"relay": bf16, "main": bf16, "prefill": ["--instance-id", "prefill-mixed"]},
                           gateway_datacenter="b", cpu_affinity={"prefill": (0,)})
    async with LocalStack(config) as running:
        yield running


@pytest.fixture(scope="module")
def mixed_generate(tiny_path: Path) -> Generate:
    return fp32_prefill_bf16_decode(tiny_path)


def mixed_prompts(tag: int) -> list[list[int]]:
    """Prompts no earlier call sent (MD's DRC would otherwise hold them)."""
    return [random_prompt(1000 * tag + n, n) for n in MIXED_PROMPT_LENGTHS]


def allowed_cores(pid: int) -> str:
    return next(line.split(":", 1)[1].strip() for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:"))


async def test_a_gateway_in_b_talks_through_bs_nats_server_and_p_keeps_to_its_core(mixed_stack: LocalStack) -> None:
    argv = {role: proc.args for role, proc in mixed_stack.processes.items()}
    nats_url_of = {role: args[args.index("--nats-url") + 1] for role, args in argv.items() if "--nats-url" in args}
    assert nats_url_of["gateway"] == nats_url_of["main"] == mixed_stack.nats_url_b
    assert nats_url_of["prefill"] == nats_url_of["relay"] == mixed_stack.nats_url
    assert allowed_cores(mixed_stack.processes["prefill"].pid) == "0"
    assert allowed_cores(mixed_stack.processes["relay"].pid) == allowed_cores(os.getpid()), "unpinned: as the launcher"


@pytest.mark.exactness
@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_fp32_prefill_with_bf16_decoders_is_token_exact_against_that_arithmetic(
        mixed_stack: LocalStack, session: aiohttp.ClientSession, mixed_generate: Generate, pipeline: str) -> None:
    handoff = {"handoff_at": 3} if pipeline == "p-rld-md" else {}
    for prompt in mixed_prompts(1 if pipeline == "p-md" else 2):
        result = await complete(session, mixed_stack, prompt, MIXED_TOKENS, pipeline=pipeline, **handoff)
        assert result.token_ids == mixed_generate(prompt, MIXED_TOKENS), f"prompt of {len(prompt)} tokens"
        # float32 on the wire: MD rounds on arrival
        assert result.summary["kv"]["main"]["kv_bytes"] >= (len(prompt) - 1) * TINY_KV_BYTES_PER_TOKEN


@pytest.mark.xfail(strict=False, reason=(
    "numerics, not a bug: float32 KV rounded to bfloat16 is not the KV a bfloat16 prefill computes, and "
    "on the tiny model greedy decoding drifts apart after a few tokens, where bfloat16 and float32 "
    "`generate` drift apart too; see the test above for what does hold"))
async def test_fp32_prefill_with_bf16_main_decode_matches_a_bf16_single_node_run(
        mixed_stack: LocalStack, session: aiohttp.ClientSession, tiny_path: Path) -> None:
    generate_bf16 = reference_generate(tiny_path, "bfloat16")
    for prompt in mixed_prompts(3):
        result = await complete(session, mixed_stack, prompt, MIXED_TOKENS, pipeline="p-md")
        assert result.token_ids == generate_bf16(prompt, MIXED_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.mark.exactness
async def test_bf16_on_the_wire_halves_the_kv_bytes_and_changes_no_token(
        mixed_stack: LocalStack, session: aiohttp.ClientSession, mixed_generate: Generate) -> None:
    restarted_at = time.time()
    await mixed_stack.restart("prefill", ["--kv-wire-dtype", "bfloat16"])
    # the new P is subscribed and beating (it imports torch afresh: long on a loaded machine)
    await heartbeat_stats(mixed_stack.nats_url, restarted_at + 0.5, RESTART_TIMEOUT_S)
    for prompt in mixed_prompts(4):
        result = await complete(session, mixed_stack, prompt, MIXED_TOKENS, pipeline="p-md")
        assert result.token_ids == mixed_generate(prompt, MIXED_TOKENS), f"prompt of {len(prompt)} tokens"
        kv_bytes = result.summary["kv"]["main"]["kv_bytes"]
        payload = (len(prompt) - 1) * TINY_KV_BYTES_PER_TOKEN // 2
        assert payload <= kv_bytes < payload + 4096, "two bytes a value, plus frame headers"
