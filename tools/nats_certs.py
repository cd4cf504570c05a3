"""Throwaway certificates for a local stack's NATS TLS: a CA, a server certificate for loopback and
a client certificate, made with the openssl CLI in a directory of the caller's.

For `pdd up --nats-auth` and tests only: the keys are unencrypted and live one day. Production
certificates come from the operator (docs/deploy.md, "Secrets").
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_DAYS = "1"


@dataclass(frozen=True)
class NatsCerts:
    ca: Path
    server_cert: Path  # SAN 127.0.0.1 and localhost; the two-dc gateway link presents it both ways
    server_key: Path
    client_cert: Path
    client_key: Path


def make_nats_certs(directory: Path) -> NatsCerts:
    """Write a CA and the certificates it signs into `directory` (created, mode 0700)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make the local stack's NATS certificates")
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=directory, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")

    run("req", "-x509", *_EC_KEY, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", _DAYS,
        "-subj", "/CN=pdd-local-nats-ca")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extfile in (("server", ["-extfile", "server.ext"]), ("client", [])):
        run("req", *_EC_KEY, "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", "-subj", f"/CN=pdd-local-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", _DAYS, *extfile)
    return NatsCerts(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem",
                     directory / "client.pem", directory / "client-key.pem")
