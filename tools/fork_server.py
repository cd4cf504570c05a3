"""A fork server for the launcher's Python services: one process imports torch, transformers and pdd's
service modules once, then forks each `python -m <module> ...` the launcher asks for from that warm
state, instead of a fresh interpreter importing them again (about 4 CPU s per model service here).

A forked service is a real process like a spawned one: its own session and process group, its own
log on stdout and stderr, the argv and environment it would have had, dying with its parent; it
runs its module as `__main__` exactly as `python -m` does. Only what an interpreter reads at start-up
differs, so the server forks only for an environment equal to its own (threads for OpenMP, paths,
sitecustomize); anything else is spawned as before. The server is single-threaded, so a fork never
copies a lock another thread holds; it has imported torch but never run an operator, so no OpenMP
pool exists to be copied either.

Protocol, one JSON object per line on a socketpair: the launcher sends {"spawn": n, "module",
"args", "log", "cores"}; the server answers {"spawned": n, "pid"} or {"spawned": n,
"error"}, and {"exited": pid, "code"} when a child ends (`code` as Popen's returncode: -N for a
signal). The launcher's side is `ForkServer`, and `ForkedChild` is what it returns: the part of
`subprocess.Popen` the launcher and the tests use.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson

from tools.processes import die_with_parent, start_child

log = logging.getLogger(__name__)

# What the server imports before its first fork: the model services' whole import graph (torch,
# transformers, the engine) and the gateway's; a module not listed still runs, importing the rest.
PRELOAD = ("services.prefill.service", "services.decoder.service", "services.relay.role", "services.main.role",
           "services.gateway.service", "wan.main")
READY = {"ready": True}
START_TIMEOUT_S = 120.0  # the server's own imports, on a loaded machine
SPAWN_TIMEOUT_S = 10.0


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(orjson.dumps(message) + b"\n")


class _Lines:
    """The protocol's messages out of a stream socket's reads, each whole once its newline came."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[dict]:
        *lines, self._rest = (self._rest + data).split(b"\n")
        return [orjson.loads(line) for line in lines]


# ---- the server process (python -m tools.fork_server FD) -------------------------------------------

def _child(inherited: Sequence[int], request: dict) -> None:
    """In the forked child: close the server's descriptors (`inherited`), become the service
    `request` names, then exit with its code."""
    code = 1
    try:
        for fd in inherited:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        if "torch" in sys.modules:  # a fresh seed, as a fresh interpreter's (`random` reseeds itself at fork)
            sys.modules["torch"].seed()
        start_child(request["cores"])
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})


def serve(fd: int, preload: Sequence[str]) -> None:
    """The server's loop: import `preload`, then fork on each request and report each child's exit;
    return when the launcher's end of the socket closes (its children die with it: each was told to
    at fork)."""
    die_with_parent()
    sock = socket.socket(fileno=fd)
    for name in preload:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, READY)
    selector = selectors.PollSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    requests = _Lines()
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:  # a SIGCHLD
                os.read(wake_r, 4096)
                _reap(sock)
                continue
            data = sock.recv(65536)
            if not data:
                return
            for request in requests.feed(data):
                try:
                    pid = os.fork()
                except OSError as exc:
                    _send(sock, {"spawned": request["spawn"], "error": str(exc)})
                    continue
                if pid == 0:
                    _child((sock.fileno(), wake_r, wake_w), request)
                _send(sock, {"spawned": request["spawn"], "pid": pid})


# ---- the launcher's side ---------------------------------------------------------------------------

class ForkServerError(RuntimeError):
    """The fork server could not start or answer; the launcher spawns processes itself instead."""


class ForkedChild:
    """A service the fork server forked: the part of `subprocess.Popen` the launcher and tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args  # the command line it runs as: `python -m module ...`
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        if self.returncode is None and not self._server.alive and not Path(f"/proc/{self.pid}").exists():
            self.returncode = -signal.SIGTERM  # reaped by a server that is gone: it died with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self._server.wait_exit(deadline):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's handle on one fork server, started with the environment its children get."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tools.fork_server", str(theirs.fileno()), *preload], pass_fds=(theirs.fileno(),),
            env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._lock = threading.Condition()
        self._spawned: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._closed = False
        self._ready = threading.Event()  # set when it is ready, or gone
        self._started = False
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    @property
    def started(self) -> bool:
        """It got ready once: a server that died after that may be replaced."""
        return self._started

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if not self._ready.wait(timeout_s) or not self.alive:
            self.close()
            raise ForkServerError(f"the fork server did not start within {timeout_s:.0f} s")

    def spawn(self, module: str, args: Sequence[str], log_path: Path, cores: Sequence[int] | None) -> ForkedChild:
        """Fork `python -m module *args`, its output appended to `log_path`, kept to `cores` if given."""
        self.wait_ready()
        with self._lock:
            self._next += 1
            n = self._next
        request = {"spawn": n, "module": module, "args": list(args), "log": str(log_path),
                   "cores": list(cores) if cores else None}
        try:
            _send(self._sock, request)
        except OSError as exc:
            raise ForkServerError(f"the fork server is gone: {exc}") from exc
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        with self._lock:
            while n not in self._spawned:
                if self._closed or not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    raise ForkServerError("the fork server did not answer")
            answer = self._spawned.pop(n)
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return ForkedChild(self, answer["pid"], [sys.executable, "-m", module, *args])

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, deadline: float | None) -> bool:
        """Wait for the next exit report (or the server's end); False once `deadline` has passed."""
        with self._lock:
            if self._closed:
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._lock.wait(remaining)
            return True

    def close(self) -> None:
        """Close the socket: the server returns, and anything it forked that still runs dies with it."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5.0)
        if self._proc.poll() is None:
            self._proc.kill()

    def _read(self) -> None:
        messages = _Lines()
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            for message in messages.feed(data):
                if message.get("ready"):
                    self._started = True
                    self._ready.set()
                    continue
                with self._lock:
                    if "exited" in message:
                        self._exits[message["exited"]] = message["code"]
                    else:
                        self._spawned[message["spawned"]] = message
                    self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._ready.set()


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_servers_lock = threading.Lock()


def fork_server_for(env: Mapping[str, str]) -> ForkServer:
    """This process's fork server for `env`, started on first use and kept for later stacks; one that
    died after starting is replaced, one that never started is kept (it fails each spawn at once)."""
    key = tuple(sorted(env.items()))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or (server.started and not server.alive):
            server = _servers[key] = ForkServer(env)
    return server


def close_fork_servers() -> None:
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
