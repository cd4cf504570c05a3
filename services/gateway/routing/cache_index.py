"""The gateway's index of what each P's prefix cache and each MD's Decode-side RadixCache hold,
fed by the cache events they publish.

Each instance publishes `stored`/`evicted` events naming radix-tree nodes by (hash of the token
prefix up to the node's end, end), plus the prefixes ending at each block boundary inside the node.
Routing never asks: it hashes a request's prompt at the ends the index knows and takes the
longest that matches. A hit that ends inside a node is under-counted by less than one block.
An instance found dead is forgotten (the registry calls `forget`): its cache died with it, and one
that restarts under the same id starts empty.
"""
from __future__ import annotations

from collections import defaultdict

from shared.prefix_hashes import prefix_hashes


class CacheIndex:
    def __init__(self) -> None:
        self._nodes: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.events_applied = 0

    def apply(self, instance_id: str, events: list[dict]) -> None:
        nodes = self._nodes[instance_id]
        for event in events:
            named = [(int(event["end"]), str(event["prefix_hash"]))]
            named += [(int(end), str(prefix_hash)) for end, prefix_hash in event.get("block_hashes", ())]
            for end, prefix_hash in named:
                if event["kind"] == "stored":
                    nodes[end].add(prefix_hash)
                elif event["kind"] == "evicted" and end in nodes:
                    nodes[end].discard(prefix_hash)
                    if not nodes[end]:
                        del nodes[end]
            self.events_applied += 1

    def hit_tokens(self, instance_id: str, token_ids: list[int]) -> int:
        """The longest prefix of token_ids that the instance is known to hold."""
        nodes = self._nodes.get(instance_id)
        if not nodes:
            return 0
        ends = [end for end in nodes if 0 < end <= len(token_ids)]
        if not ends:
            return 0
        hashes = prefix_hashes(token_ids, ends)
        return max((end for end in ends if hashes[end] in nodes[end]), default=0)

    def forget(self, instance_id: str) -> None:
        """The instance's process is gone: nothing it cached is there any more."""
        self._nodes.pop(instance_id, None)

    def instances(self) -> list[str]:
        return list(self._nodes)
