"""The one lifecycle of a KV transfer, on both sides: the states and the moves between them.

A receiver's `KVInbox` and a sender's `OutgoingTransfer` are each a `TransferMachine`; a move the
table does not allow is a bug and fails loudly (`shared.lifecycle.checked_move`).
"""
from __future__ import annotations

import enum

from shared.lifecycle import checked_move


class TransferState(enum.Enum):
    WAITING = "waiting"  # opened: the sender has not written KV yet (P's engine may still be computing)
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


_NEXT: dict[TransferState, set[TransferState]] = {
    TransferState.WAITING: {TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED,
                            TransferState.ABORTED},
    TransferState.TRANSFERRING: {TransferState.DONE, TransferState.FAILED, TransferState.ABORTED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
    TransferState.ABORTED: set(),
}


class TransferMachine:
    """A transfer's state, moved only by `_move`."""

    state = TransferState.WAITING

    def _move(self, new: TransferState) -> None:
        self.state = checked_move(_NEXT, self.state, new, "KV transfer")

    @property
    def ended(self) -> bool:
        return not _NEXT[self.state]
