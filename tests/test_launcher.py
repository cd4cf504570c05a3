"""The launcher starts a whole local stack as processes and leaves nothing behind when it stops.

Fast tests first (a taken port, a service that dies at once), then `pdd up` as a user
runs it, then one stack on the tiny model shared by the rest of the module; the last test stops it.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import nats
import pytest

from shared.config import DEFAULT_MAX_PAYLOAD_BYTES
from shared.models import served_model_name
from tools.demo import DemoOptions, TierPainter, run_demo
from tools.launcher import LocalStack
from tools.stack_config import NATS, SERVICES, StackConfig, StackError

from helpers import process_alive, stack_config

STARTUP_TIMEOUT_S = 150.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


STACK = {"log_level": "INFO", "startup_timeout_s": STARTUP_TIMEOUT_S}


def _tiny(tmp_path: Path, **overrides: object) -> StackConfig:
    return stack_config(tmp_path / "logs", **{**STACK, **overrides})


@pytest.mark.timeout(90)
async def test_a_service_that_exits_fails_the_start_with_its_log_tail(tmp_path: Path) -> None:
    stack = LocalStack(_tiny(tmp_path, extra_args={"relay": ["--no-such-flag"]}))
    with pytest.raises(StackError, match=r"(?s)relay exited with code 2.*--no-such-flag"):
        await stack.start()
    pids = [p.pid for p in stack.processes.values()]
    assert set(stack.processes) == {NATS, *SERVICES}
    assert not any(process_alive(pid) for pid in pids), "a failed start stops everything it started"


@pytest.mark.timeout(60)
async def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        stack = LocalStack(_tiny(tmp_path, port=taken.getsockname()[1]))
        with pytest.raises(StackError, match="in use"):
            await stack.start()
    assert stack.processes == {}


def test_free_port_never_hands_out_a_port_twice(monkeypatch) -> None:
    """A stack picks all its ports before any process binds one: two equal picks would leave the
    second process unable to bind (it happened: nats-b's client port and MD's KV port). Picked
    from a 1,000-port range, 400 picks would repeat one almost surely if nothing prevented it."""
    from tools import stack_config

    monkeypatch.setattr(stack_config, "_ephemeral_port_range",
                        lambda: (stack_config.PICKED_PORTS_FROM + 1000, 60999))
    picks = [stack_config.free_port() for _ in range(400)]
    assert len(set(picks)) == len(picks)
    assert all(stack_config.PICKED_PORTS_FROM <= p < stack_config.PICKED_PORTS_FROM + 1000 for p in picks)


def test_free_port_never_hands_out_a_port_twice_when_the_kernel_picks_it(monkeypatch) -> None:
    """No room below the ephemeral range: the kernel's picks are checked against earlier ones too."""
    from tools import stack_config

    monkeypatch.setattr(stack_config, "_ephemeral_port_range", lambda: (stack_config.PICKED_PORTS_FROM, 60999))
    picks = [stack_config.free_port() for _ in range(50)]
    assert len(set(picks)) == len(picks)


def test_pdd_up_takes_the_gateways_api_key_and_running_limit_as_flags(tmp_path: Path) -> None:
    from tools.cli import build_parser

    ns = build_parser().parse_args(["up", "--api-key-file", str(tmp_path / "key"), "--max-running-requests", "3"])
    config = StackConfig.from_namespace(ns)
    assert (config.api_key_file, config.max_running_requests) == (tmp_path / "key", 3)
    defaults = StackConfig.from_namespace(build_parser().parse_args(["up"]))
    assert (defaults.api_key_file, defaults.max_running_requests) == (None, None)  # open, the gateway's limit
    # that the gateway gets them, and enforces them, is tests/test_access_and_load.py's stack


def _sse(tokens: list[tuple[str, str]], pipeline: str = "p-rld-md", handoff: dict | None = None) -> bytes:
    """One SSE event as the gateway sends it: text plus the "pdd" extension naming each token's tier."""
    ext: dict = {"tokens": [{"index": i, "tier": tier} for i, (_, tier) in enumerate(tokens)], "pipeline": pipeline}
    if handoff is not None:
        ext["handoff"] = handoff
    chunk = {"object": "chat.completion.chunk", "pdd": ext,
             "choices": [{"index": 0, "delta": {"content": "".join(t for t, _ in tokens)}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def test_demo_marks_each_tier_and_the_handoff_where_md_takes_over() -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["pdd"] == {"pipeline": "p-rld-md", "md_kv_delay_ms": 400.0}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse([("The", "relay"), (" sky", "relay")]))
        await resp.write(_sse([(" is", "main")], handoff={"eager_tokens": 2, "handoff_s": 0.012}))
        await resp.write(_sse([(" blue", "main"), (".", "main")]))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        out = io.StringIO()
        async with asyncio.timeout(10):
            result = await run_demo(f"http://127.0.0.1:{port}", DemoOptions(), out,
                                    painter=TierPainter(out, colour=False))
    finally:
        await runner.cleanup()
    assert out.getvalue() == "[RLD]The sky |handoff after 2 eager tokens, 12 ms| [MD] is blue.\n"
    assert result.tokens_by_tier == {"relay": 2, "main": 3}
    assert result.text == "The sky is blue."
    assert "after 2 eager tokens" in result.summary()


@pytest.mark.parametrize("flags", [[], ["--pipeline", "p-md"], ["--pipeline", "p-rld-md"], ["--pipeline", "auto"]])
def test_every_demo_pipeline_flag_sends_a_pdd_field_the_gateway_accepts(flags: list[str]) -> None:
    """`pdd demo` shares `pdd up`'s flags, whose --pipeline default is `auto`: a value the request's
    `pdd.pipeline` must never carry (the gateway answered the newcomer's demo with a 400)."""
    from services.gateway.http.request_parsing import _pdd_extension
    from tools.cli import _demo_options, build_parser

    options = _demo_options(build_parser().parse_args(["demo", *flags]))
    ext = options.request_body(model=None)["pdd"]
    assert isinstance(ext, dict)
    pipeline, *_ = _pdd_extension(ext)  # raises InvalidParam, the gateway's 400, on a field it refuses
    expected = {"": "p-rld-md", "p-md": "p-md", "p-rld-md": "p-rld-md", "auto": None}["".join(flags[1:])]
    assert pipeline == expected  # no flag: P-RLD-MD, so the demo shows a handoff; auto: the gateway chooses


def test_a_demo_pipeline_the_gateway_would_refuse_fails_before_any_request() -> None:
    with pytest.raises(ValueError, match="demo pipeline must be one of"):
        DemoOptions(pipeline="p-rld")


def _pdd_command() -> list[str]:
    script = Path(sys.executable).parent / "pdd"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 60)
async def test_pdd_up_prints_the_api_url_and_exits_0_on_sigterm_leaving_no_process(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    proc = await asyncio.create_subprocess_exec(
        *_pdd_command(), "up", "--model", "tiny", "--port", "0", "--log-dir", str(log_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    output: list[str] = []
    pids: dict[str, int] = {}
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while not (match := re.search(r"OpenAI API at (http://\S+)/v1", "".join(output))):
                line = await proc.stdout.readline()
                assert line, "pdd up exited before it was ready:\n" + "".join(output)
                output.append(line.decode())
        api_url = match.group(1)
        pids = json.loads((log_dir / "stack.json").read_text())["pids"]
        assert set(pids) == {NATS, *SERVICES}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{api_url}/healthz") as resp:
                assert resp.status == 200

        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            rest, _ = await proc.communicate()
        output.append(rest.decode())
        assert proc.returncode == 0, "".join(output)
        assert not [role for role, pid in pids.items() if process_alive(pid)]
        assert not (log_dir / "stack.json").exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in pids.values():
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


async def _start_pdd_up(log_dir: Path, *flags: str) -> tuple[asyncio.subprocess.Process, str, dict[str, int]]:
    """`pdd up` with the tiny model as a child process: it, its API URL, and its services' pids."""
    proc = await asyncio.create_subprocess_exec(
        *_pdd_command(), "up", "--model", "tiny", "--port", "0", "--log-dir", str(log_dir), *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    output = ""
    async with asyncio.timeout(STARTUP_TIMEOUT_S):
        while not (match := re.search(r"OpenAI API at (http://\S+)/v1", output)):
            line = await proc.stdout.readline()
            assert line, "pdd up exited before it was ready:\n" + output
            output += line.decode()
    return proc, match.group(1), json.loads((log_dir / "stack.json").read_text())["pids"]


async def _healthz(api_url: str) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(f"{api_url}/healthz") as resp:
            return resp.status


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 60)
async def test_pdd_up_reports_a_service_that_exits_and_stops_the_stack(tmp_path: Path) -> None:
    proc, _, pids = await _start_pdd_up(tmp_path / "logs")
    try:
        os.killpg(pids["main"], signal.SIGKILL)
        async with asyncio.timeout(30):  # noticed within a poll, then the ordered stop
            rest, _ = await proc.communicate()
        assert proc.returncode == 1
        assert "main exited" in rest.decode() and "exited with code -9" in rest.decode(), rest.decode()
        assert not [role for role, pid in pids.items() if process_alive(pid)], "no zombie, nothing left running"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in pids.values():
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(STARTUP_TIMEOUT_S * 2 + 60)
async def test_pdd_up_restarts_a_service_that_exits_when_asked(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    proc, api_url, pids = await _start_pdd_up(log_dir, "--on-child-exit", "restart")
    try:
        os.killpg(pids["relay"], signal.SIGKILL)
        async with asyncio.timeout(STARTUP_TIMEOUT_S):  # a new relay, under a new pid, announces itself
            while (new := json.loads((log_dir / "stack.json").read_text())["pids"]["relay"]) == pids["relay"] \
                    or await _healthz(api_url) != 200:
                await asyncio.sleep(0.5)
        assert process_alive(new) and proc.returncode is None
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            await proc.communicate()
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in json.loads((log_dir / "stack.json").read_text())["pids"].values() \
                if (log_dir / "stack.json").exists() else pids.values():
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 30)
async def test_stack_is_healthy_with_every_role_and_a_log_file_each(stack: LocalStack) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(f"{stack.api_url}/healthz") as resp:
            assert resp.status == 200
            health = await resp.json()
    assert health["status"] == "ok"
    assert all(health["instances"][role] >= 1 for role in ("prefill", "relay", "main"))
    for role in (NATS, *SERVICES):
        assert stack.log_paths[role].is_file()
        assert stack.processes[role].poll() is None
    assert stack.nats_url.startswith("nats://127.0.0.1:")


@pytest.mark.timeout(30)
async def test_own_nats_server_takes_messages_up_to_the_configured_max_payload(stack: LocalStack) -> None:
    client = await nats.connect(stack.nats_url, connect_timeout=5)
    try:
        assert client.max_payload == DEFAULT_MAX_PAYLOAD_BYTES
        inbox = await client.subscribe("pdd.test.launcher.big")
        await client.publish("pdd.test.launcher.big", b"x" * (DEFAULT_MAX_PAYLOAD_BYTES - 4096))
        msg = await inbox.next_msg(timeout=5)
        assert len(msg.data) == DEFAULT_MAX_PAYLOAD_BYTES - 4096
    finally:
        await client.close()


@pytest.mark.timeout(120)
async def test_demo_streams_an_answer_with_every_token_marked_by_tier(stack: LocalStack) -> None:
    out = io.StringIO()
    assert stack.model_path is not None
    result = await run_demo(stack.api_url, DemoOptions(max_tokens=24, md_kv_delay_ms=200), out,
                            model=served_model_name(stack.model_path), painter=TierPainter(out, colour=False))
    assert result.tokens >= 1
    assert set(result.tokens_by_tier) <= {"prefill", "relay", "main"}
    assert result.pipeline == "p-rld-md"
    assert result.ttft_s is not None and result.ttft_s < result.total_s
    printed = out.getvalue()
    assert printed.startswith("[")  # the first segment names its tier
    if result.tokens_by_tier["main"] and result.tokens_by_tier["relay"]:
        assert result.handoff is not None
        assert "|handoff" in printed
    assert "eager tokens by RLD" in result.summary() or "tokens by MD" in result.summary()


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 30)
async def test_a_killed_role_can_be_restarted(stack: LocalStack) -> None:
    old = stack.processes["relay"]
    stack.kill("relay")
    async with asyncio.timeout(10):
        while old.poll() is None:
            await asyncio.sleep(0.05)
    assert old.returncode == -signal.SIGKILL
    new = await stack.restart("relay")
    assert new.pid != old.pid
    health = await stack.wait_healthy(STARTUP_TIMEOUT_S)
    assert health["instances"]["relay"] >= 1
    assert new.poll() is None
    assert "restarted by the launcher" in stack.log_paths["relay"].read_text()


@pytest.mark.timeout(60)
async def test_stop_leaves_no_process_of_the_stack(stack: LocalStack) -> None:
    pids = {role: proc.pid for role, proc in stack.processes.items()}
    await stack.stop()
    assert not [role for role, pid in pids.items() if process_alive(pid) or _group_alive(pid)]
    assert all(proc.returncode is not None for proc in stack.processes.values())
    assert not stack.state_path.exists()
    await stack.stop()  # idempotent
