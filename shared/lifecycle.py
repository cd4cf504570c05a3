"""The one rule of every request lifecycle in pdd (P's job, a decoder's request, the gateway's attempt
and run): a move its table does not allow is a bug, and fails loudly."""
from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from typing import TypeVar

P = TypeVar("P", bound=enum.Enum)


class IllegalMove(RuntimeError):
    """A phase move the lifecycle's table does not allow."""


def checked_move(moves: Mapping[P, Set[P]], current: P, new: P, what: str) -> P:
    """`new`, when the table allows current -> new; IllegalMove naming `what` otherwise."""
    if new not in moves[current]:
        raise IllegalMove(f"{what}: illegal move {current.value} -> {new.value}")
    return new
