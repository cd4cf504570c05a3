"""Child processes of the launcher: each in its own session, dying with its parent, signalled as a group
(spawned, or forked by tools/fork_server.py); and the tail of a log file for error messages."""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

POLL_S = 0.05


class ChildProcess(Protocol):
    """What the launcher needs of a child: a `subprocess.Popen`, or a service forked by
    tools/fork_server.py."""

    pid: int
    args: Any  # its command line
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def log_tail(path: Path, max_chars: int = 3000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """Runs in the child between fork and exec: if the launcher dies hard, the child gets SIGTERM."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def start_child(cores: Sequence[int] | None = None) -> None:
    """Runs in the child between fork and exec: die with the launcher, and keep to `cores` when given."""
    die_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)


def signal_group(proc: ChildProcess, sig: int, *, after_exit: bool = False) -> None:
    """Signal the child's whole group; once the child is reaped, only when asked (its pid may be reused)."""
    if proc.poll() is not None and not after_exit:
        return
    try:
        os.killpg(proc.pid, sig)  # each child leads its own session, so its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


async def wait_exited(procs: Sequence[ChildProcess], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
