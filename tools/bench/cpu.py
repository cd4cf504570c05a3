"""CPU seconds a stack's processes (and their descendants) and the bench client itself used, read from
/proc: what a run cost the machine, beside what it measured. Linux only; elsewhere nothing is counted.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")
CLIENT = "client"  # the bench process itself: the replaying client, its event loop and the launcher


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, None if it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...; utime is field 14
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            tree.setdefault(stat[0], []).append(int(entry.name))
    return tree


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process with its live descendants, and of this process (CLIENT)."""
    if not PROC.is_dir():
        return {}
    tree = _children()
    used: dict[str, float] = {}
    for name, pid in pids.items():
        total, todo = 0.0, [pid]
        while todo:
            current = todo.pop()
            if (stat := _stat(current)) is not None:
                total += stat[1]
                todo += tree.get(current, [])
        used[name] = total
    times = os.times()
    used[CLIENT] = times.user + times.system
    return used


def used_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two readings (a process that restarted counts from 0)."""
    used = {}
    for name, now in after.items():
        then = before.get(name, 0.0)
        used[name] = round(now - then if now >= then else now, 3)
    return used
