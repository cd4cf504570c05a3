"""The batch engine's timeline (`--engine-timeline FILE`): what its thread did and when, one JSON
object a line, for latency debugging below the request traces.

Events: `step` (when it began and ended, the engine thread's CPU time in it, its rows: request,
tokens fed, whether it sampled, when the work was submitted), `command` (work run between steps: a
KV copy, an admission, a release), `hold` (the engine waiting for announced work) and `mark` (a
service's own moment, e.g. MD receiving a cut).
Times are wall-clock nanoseconds (time.time_ns), so the files of several processes on one host line
up. Off by default; on, an event costs one buffered write, flushed at most every `FLUSH_S`.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import orjson

FLUSH_S = 0.5


class EngineTimeline:
    """An append-only JSON-lines file; safe to write from the engine thread and the event loop."""

    def __init__(self, path: str | Path, engine: str) -> None:
        self.path = Path(path)
        self.engine = engine
        self._lock = threading.Lock()
        self._file = self.path.open("ab")
        self._flushed_at = time.monotonic()

    def write(self, kind: str, **fields: object) -> None:
        line = orjson.dumps({"kind": kind, "engine": self.engine, **fields}) + b"\n"
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
            if time.monotonic() - self._flushed_at >= FLUSH_S:
                self._file.flush()
                self._flushed_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def read_timeline(path: str | Path) -> list[dict[str, object]]:
    """Every event of a timeline file, in the order written (a torn last line is skipped)."""
    events = []
    for line in Path(path).read_bytes().splitlines():
        try:
            events.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return events
