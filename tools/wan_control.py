"""Client of the WAN emulator's control API (wan/main.py): byte counters, cuts, restores, live reshaping."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp

from tools.stack_config import StackError
from wan.emulator import WanStats


class WanControl:
    """Client of the WAN emulator's control API: read the byte counters, cut, restore, reshape."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _call(self, method: str, path: str, body: Mapping[str, object] | None = None,
                    params: Mapping[str, str] | None = None) -> dict[str, object]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.request(method, self.url + path, json=body, params=params) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200:
                raise StackError(f"WAN control {method} {path}: HTTP {resp.status}: {reply}")
            return reply  # type: ignore[no-any-return]

    async def stats(self) -> WanStats:
        """Link state and config, and bytes per direction, in total and per route."""
        return await self._call("GET", "/stats")  # type: ignore[return-value]

    async def cut(self, mode: str = "reset", routes: Sequence[str] | None = None) -> dict[str, object]:
        """"reset": RST the connections and refuse new ones; "blackhole": nothing moves. On every
        route, or only on `routes` (names as in stats()["routes"]); returns the state and cut routes."""
        return await self._call("POST", "/cut", params={"mode": mode, **self._routes_param(routes)})

    async def restore(self, routes: Sequence[str] | None = None) -> dict[str, object]:
        """Bring every route back, or only `routes`."""
        return await self._call("POST", "/restore", params=self._routes_param(routes))

    @staticmethod
    def _routes_param(routes: Sequence[str] | None) -> dict[str, str]:
        return {} if routes is None else {"routes": ",".join(routes)}

    async def set_link(self, **link: object) -> dict[str, object]:
        """Change the line live: bandwidth_mbps, delay_ms, jitter_ms, or any LinkConfig field."""
        return await self._call("POST", "/link", link)
