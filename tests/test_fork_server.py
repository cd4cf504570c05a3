"""The fork server (tools/fork_server.py) on real processes: a forked module runs as `python -m` would,
with its argv, log, exit code, session and cores; signals and deadlines reach it; the server ends
with its launcher's socket, and the processes it forked end with it."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.fork_server import ForkServer

PRELOAD = ("wan.main",)  # light: the launcher's own list imports torch (seconds per server)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer(dict(os.environ, PYTHONUNBUFFERED="1"), preload=PRELOAD)
    forks.wait_ready()
    yield forks
    forks.close()


def wait_for_text(path: Path, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (found := path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in {path}: {found!r}"
        time.sleep(0.05)
    return found


def test_a_forked_module_gets_its_argv_log_and_exit_code(server, tmp_path):
    log = tmp_path / "wan.log"
    child = server.spawn("wan", ["--bogus"], log, cores=None)
    assert child.wait(timeout=20) == 2  # argparse's exit code for a bad flag
    assert "python -m wan: error" in log.read_text()
    assert server.spawn("wan", ["--help"], log, cores=None).wait(timeout=20) == 0
    text = log.read_text()
    assert "python -m wan: error" in text and "usage: python -m wan" in text  # appended: the launcher truncates


def test_a_forked_service_leads_its_own_session_keeps_to_its_cores_and_dies_by_its_signal(server, tmp_path):
    log = tmp_path / "http.log"
    core = sorted(os.sched_getaffinity(0))[0]
    child = server.spawn("http.server", ["0", "--bind", "127.0.0.1"], log, cores=[core])
    wait_for_text(log, "Serving HTTP on 127.0.0.1")
    assert child.poll() is None and child.returncode is None
    assert os.getsid(child.pid) == child.pid and os.getpgid(child.pid) == child.pid
    assert os.sched_getaffinity(child.pid) == {core}
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=20) == -signal.SIGTERM
    child.kill()  # once it has exited, a signal is a no-op (its pid may be reused)


def test_closing_the_server_ends_what_it_forked(tmp_path):
    forks = ForkServer(dict(os.environ, PYTHONUNBUFFERED="1"), preload=PRELOAD)
    forks.wait_ready()
    log = tmp_path / "http.log"
    child = forks.spawn("http.server", ["0", "--bind", "127.0.0.1"], log, cores=None)
    wait_for_text(log, "Serving HTTP")
    forks.close()
    assert not forks.alive
    deadline = time.monotonic() + 20
    while child.poll() is None:
        assert time.monotonic() < deadline, "the forked child outlived its server"
        time.sleep(0.05)
    assert child.returncode is not None and child.returncode < 0
