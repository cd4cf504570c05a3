"""An operator's mistake at start ends a service with exit status 1 and one line that names what to
create or change, not a traceback: a container's log (`docker compose logs`) shows its last lines."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_NATS = ["--nats-url", "nats://127.0.0.1:1"]  # never reached: each mistake stops the service first


@pytest.mark.parametrize(("argv", "expected"), [
    (["services.relay", "--model", "tiny", "--kv-secret-file", "/nonexistent/kv-secret"],
     "--kv-secret-file /nonexistent/kv-secret: No such file or directory: P, RLD and MD each need the same secret "
     'file (docs/deploy.md, "Secrets")'),
    (["services.gateway", "--model", "tiny", "--nats-user", "pdd", "--nats-password-file", "/nonexistent/pw"],
     "gateway cannot start: --nats-password-file /nonexistent/pw: no such file"),
    (["services.prefill", "--model", "nope"],
     "prefill cannot start: --model 'nope': not 'smollm2', 'tiny', or a directory with config.json"),
], ids=["no-kv-secret", "no-nats-password", "unknown-model"])
def test_a_mistake_at_start_is_one_line_and_exit_status_1(argv: list[str], expected: str) -> None:
    result = subprocess.run([sys.executable, "-m", *argv, *NO_NATS], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == expected
    assert "Traceback" not in result.stderr
