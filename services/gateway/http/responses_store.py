"""The gateway's memory of recent responses, for `previous_response_id` and GET /v1/responses/{id}:
a least-recently-used map bounded by the bytes it holds, in this gateway process only.

A plain class; knows nothing of HTTP or of what the items mean.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import orjson

Json = dict[str, object]

DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: Json  # the response object as it was answered
    items: list[Json]  # its conversation: earlier items, its input, its output (normalised input items)
    size_bytes: int


class ResponseStore:
    """Responses by id, the least recently used dropped once the total passes `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._budget_bytes = budget_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: Json, items: list[Json]) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(items))
        if size > self._budget_bytes:
            return  # not kept: it alone would push out everything else
        response_id = str(response["id"])
        self.delete(response_id)
        self._responses[response_id] = StoredResponse(response, items, size)
        self.size_bytes += size
        while self.size_bytes > self._budget_bytes:
            _, dropped = self._responses.popitem(last=False)
            self.size_bytes -= dropped.size_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self.size_bytes -= stored.size_bytes
        return stored is not None
