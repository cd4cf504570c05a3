"""The gateway's timeline page for a real request: its JSON routes, and the page itself drawn by
headless Chromium (skipped where Chromium is not installed: `apt-get install chromium`).

`PDD_DASHBOARD_SCREENSHOT=docs/img/dashboard.png` makes the browser test also write the
screenshot the docs show.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tools.api_client import StreamResult, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import free_port

TRACE_WAIT_S = 20.0
BROWSER_TIMEOUT_S = 90.0
SERVICES = ["gateway", "main", "prefill", "relay"]
STAGES = ("prefill.chunk", "prefill.kv_transfer", "relay.eager_decode", "relay.handoff_chunk", "main.extend_decode",
          "main.decode")
PROMPT = "Once upon a time there was a serving system split across two datacenters. " * 8


def find_chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name)) is not None), None)


@pytest.fixture(scope="module")
def stack_overrides() -> Iterator[dict[str, object]]:
    port = free_port()  # the gateway is every service's OTLP endpoint, so its port is chosen first
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        yield {"port": port,
               "extra_args": {role: ["--otlp-endpoint", endpoint] for role in ("gateway", "prefill", "relay", "main")}}


@pytest.fixture(scope="module")
async def traced(stack: LocalStack, session: aiohttp.ClientSession, tiny_tokenizer) -> StreamResult:
    """One P-RLD-MD request with a visible handoff, once its spans from all four services are in."""
    body = {"model": "tiny-llama", "prompt": tiny_tokenizer(PROMPT)["input_ids"], "max_tokens": 48,
            "temperature": 0, "pdd": {"pipeline": "p-rld-md", "md_kv_delay_ms": 100, "handoff_at": 16}}
    result = await stream_completion(session, stack.api_url, body)
    trace_id = result.summary["trace_id"]
    deadline = time.monotonic() + TRACE_WAIT_S
    while time.monotonic() < deadline:
        async with session.get(f"{stack.api_url}/dashboard/api/traces/{trace_id}") as resp:
            names = {row["name"] for row in (await resp.json())["rows"]} if resp.status == 200 else set()
        if set(STAGES) | {"gateway.request"} <= names:
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"the trace of {trace_id} did not fill in within {TRACE_WAIT_S}s")


async def test_dashboard_lists_the_request_with_tokens_per_tier(stack, session, traced):
    async with session.get(f"{stack.api_url}/dashboard") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        assert "waterfall" in await resp.text()
    async with session.get(f"{stack.api_url}/dashboard/api/traces") as resp:
        traces = (await resp.json())["traces"]
    (listed,) = [t for t in traces if t["trace_id"] == traced.summary["trace_id"]]
    assert listed["services"] == SERVICES and listed["pipeline"] == "p-rld-md" and not listed["error"]
    assert listed["tokens"] == {"relay": 16, "main": 32} and listed["ttft_ms"] > 0
    async with session.get(f"{stack.api_url}/dashboard/api/traces/{'0' * 32}") as resp:
        assert resp.status == 404


async def test_waterfall_rows_are_in_request_order_with_details(stack, session, traced):
    async with session.get(f"{stack.api_url}/dashboard/api/traces/{traced.summary['trace_id']}") as resp:
        rows = (await resp.json())["rows"]
    tiers_in_order = [row["tier"] for row in rows if row["depth"] == 2]  # the children of gateway.dispatch
    assert tiers_in_order == ["prefill", "relay", "main"]
    details = {row["name"]: row["detail"] for row in rows}
    assert details["relay.eager_decode"].startswith("16 eager tokens")
    assert details["main.decode"] == "32 tokens"
    assert all(row["start_ms"] >= 0 and row["duration_ms"] >= 0 for row in rows)


async def run_chromium(*args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with asyncio.timeout(BROWSER_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return out


@pytest.mark.skipif(find_chromium() is None, reason="headless Chromium not installed (apt-get install chromium)")
async def test_browser_draws_the_waterfall(stack, traced, tmp_path: Path):
    url = f"{stack.api_url}/dashboard#{traced.summary['trace_id']}"
    common = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1400,900", "--virtual-time-budget=5000"]  # lets the page's fetches finish
    dom = (await run_chromium(*common, f"--user-data-dir={tmp_path / 'dom'}", "--dump-dom", url)).decode()
    for stage in STAGES:
        assert stage in dom, f"{stage} not drawn"
    assert "first token" in dom and "handoff" in dom and "RLD 16" in dom and "MD 32" in dom

    shot = Path(os.environ.get("PDD_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png").resolve()
    shot.parent.mkdir(parents=True, exist_ok=True)
    await run_chromium(*common, f"--user-data-dir={tmp_path / 'shot'}", f"--screenshot={shot}", url)
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
