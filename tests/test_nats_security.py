"""NATS with a user, a password and mutual TLS, on real nats-servers.

One two-dc stack (tiny model) runs with `nats_auth`: both nats-servers demand a password and a
client certificate, and their gateway link through the WAN emulator is mutual TLS. It serves
token-exact; the servers refuse clients that lack the password or the certificate; a service
whose credential files are missing or empty fails at connect with a message naming the flag.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from pathlib import Path

import nats
import pytest
from nats.errors import Error as NatsError

from shared import bus
from shared.bus import NatsConfigError
from shared.config import GatewayConfig, NatsAuth
from tools.api_client import stream_completion
from tools.launcher import LocalStack
from tools.processes import log_tail
from tools.stack_config import NATS_B, NATS_GW_A_ROUTE, NATS_GW_B_ROUTE, StackConfig

from helpers import random_prompt

MAX_TOKENS = 16


STACK = {"topology": "two-dc", "wan_bandwidth_mbps": 0.0, "wan_delay_ms": 2.0, "wan_jitter_ms": 0.0, "nats_auth": True}


@pytest.fixture(scope="module")
def auth(stack: LocalStack) -> NatsAuth:
    assert stack.nats_auth is not None
    return stack.nats_auth


async def test_a_stack_behind_nats_passwords_and_mutual_tls_serves_token_exact(stack, session, tiny_generate):
    for seed, pipeline in ((1, "p-rld-md"), (2, "p-md")):
        prompt = random_prompt(seed, 40)
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "pdd": {"pipeline": pipeline}}
        result = await stream_completion(session, stack.api_url, body)
        assert result.token_ids == tiny_generate(prompt, MAX_TOKENS)
        assert "main" in result.tiers  # MD, in datacenter B, reached through the TLS gateway link
    routes = (await stack.wan.stats())["routes"]
    for route in (NATS_GW_A_ROUTE, NATS_GW_B_ROUTE):  # the gateway link ran through the emulator, both ways
        assert routes[route]["a_to_b"]["bytes"] > 0 and routes[route]["b_to_a"]["bytes"] > 0
    for conf in ("nats-a.conf", "nats-b.conf"):
        text = (stack.log_dir / conf).read_text()
        assert text.count("verify: true") == 2 and "authorization" in text  # clients, and the gateway link


async def test_the_stacks_own_credentials_connect_to_both_datacenters(stack, auth):
    assert Path(auth.password_file).stat().st_mode & 0o077 == 0
    for url in (stack.nats_url, stack.nats_url_b):
        nc = await bus.connect(url, "test-nats-security", auth)
        await nc.flush(timeout=5)
        await nc.close()


@pytest.mark.parametrize("lacking", ["wrong-password", "no-password", "no-tls"])
async def test_a_client_without_the_right_password_or_tls_is_refused_at_once(stack, auth, tmp_path, lacking):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    without = {"wrong-password": replace(auth, password_file=str(wrong)),
               "no-password": replace(auth, user="", password_file=""),
               "no-tls": replace(auth, tls_ca="", tls_cert="", tls_key="")}[lacking]
    expected = "CERTIFICATE_VERIFY_FAILED" if lacking == "no-tls" else "Authorization Violation"
    async with asyncio.timeout(15):  # refused: no retrying until a deadline
        with pytest.raises(NatsConfigError, match=expected):
            await bus.connect(stack.nats_url, "test-refused", without)


async def test_a_client_without_a_certificate_is_refused_by_the_server(stack, auth):
    # The password and the CA are right; only the client certificate is missing. The server ends the
    # TLS handshake, which a client cannot tell from a network fault, so ask nats-py for one attempt.
    no_cert = bus.nats_credentials(replace(auth, tls_cert="", tls_key=""))

    async def quiet(exc: Exception) -> None:
        pass

    with pytest.raises((OSError, NatsError)):
        await nats.connect(stack.nats_url_b, allow_reconnect=False, connect_timeout=5, error_cb=quiet, **no_cert)
    await asyncio.sleep(0.2)
    assert "client didn't provide a certificate" in log_tail(stack.log_paths[NATS_B], 20_000)


@pytest.mark.parametrize(("field", "flag", "content"), [
    ("password_file", "--nats-password-file", None),
    ("password_file", "--nats-password-file", ""),
    ("tls_ca", "--nats-tls-ca", None),
    ("tls_key", "--nats-tls-key", None),
], ids=["missing-password", "empty-password", "missing-ca", "missing-key"])
async def test_a_missing_or_empty_credential_file_fails_with_the_flag_named(auth, tmp_path, field, flag, content):
    path = tmp_path / "credential"
    if content is not None:
        path.write_text(content)
    with pytest.raises(NatsConfigError, match=f"{flag} {re.escape(str(path))}: (no such file|the file is empty)"):
        await bus.connect("nats://127.0.0.1:1", "test-missing-file", replace(auth, **{field: str(path)}))


def test_nats_flags_and_environment_reach_every_services_config(monkeypatch, tmp_path):
    monkeypatch.setenv("PDD_NATS_TLS_CA", "/secrets/ca.pem")
    config = GatewayConfig.from_argv(["--nats-user", "pdd", "--nats-password-file", "/secrets/nats-password",
                                      "--nats-tls-cert", "/secrets/client.pem", "--nats-tls-key", "/secrets/key.pem"])
    assert config.common.nats_auth == NatsAuth("pdd", "/secrets/nats-password", "/secrets/ca.pem",
                                               "/secrets/client.pem", "/secrets/key.pem")
    with pytest.raises(ValueError, match="--nats-user and --nats-password-file go together"):
        GatewayConfig.from_argv(["--nats-user", "pdd"])
    monkeypatch.delenv("PDD_NATS_TLS_CA")
    assert GatewayConfig.from_argv([]).common.nats_auth == NatsAuth()


def test_nats_auth_is_for_the_launchers_own_server_only() -> None:
    with pytest.raises(ValueError, match="PDD_NATS_USER"):
        StackConfig(nats_url="nats://127.0.0.1:4222", nats_auth=True)
