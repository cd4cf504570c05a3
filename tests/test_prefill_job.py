"""P's request lifecycle (services/prefill/job.py): the moves it allows, the ones it refuses, and
what a job queues on each KV path."""
from __future__ import annotations

import uuid

import pytest
import torch

from services.prefill.job import Phase, PrefillJob
from shared.lifecycle import IllegalMove
from shared.messages import KVTarget, PrefillRequest
from shared.names import Role


def _job(prompt_tokens: int = 11, targets: list[KVTarget] | None = None) -> PrefillJob:
    return PrefillJob(PrefillRequest("req-" + uuid.uuid4().hex, list(range(prompt_tokens)), targets or [], 30.0))


@pytest.mark.parametrize("end", [Phase.DONE, Phase.FAILED])
def test_a_job_runs_accepted_computing_sending_to_its_end(end: Phase) -> None:
    job = _job()
    assert job.phase is Phase.ACCEPTED and not job.ended
    for phase in (Phase.COMPUTING, Phase.SENDING, end):
        job.move(phase)
    assert job.phase is end and job.ended


@pytest.mark.parametrize("path", [[], [Phase.COMPUTING], [Phase.COMPUTING, Phase.SENDING]])
@pytest.mark.parametrize("end", [Phase.ABORTED, Phase.FAILED])
def test_a_job_can_be_aborted_or_fail_in_any_live_phase(path: list[Phase], end: Phase) -> None:
    job = _job()
    for phase in path:
        job.move(phase)
    job.move(end)
    assert job.ended


@pytest.mark.parametrize("path, illegal", [
    ([], Phase.SENDING),  # sending before computing
    ([], Phase.DONE),
    ([Phase.COMPUTING], Phase.DONE),  # done while chunks are still being computed
    ([Phase.COMPUTING], Phase.ACCEPTED),
    ([Phase.COMPUTING, Phase.SENDING], Phase.COMPUTING),
])
def test_illegal_moves_raise_and_leave_the_phase(path: list[Phase], illegal: Phase) -> None:
    job = _job()
    for phase in path:
        job.move(phase)
    before = job.phase
    with pytest.raises(IllegalMove, match=f"{before.value} -> {illegal.value}"):
        job.move(illegal)
    assert job.phase is before


@pytest.mark.parametrize("end", [Phase.DONE, Phase.FAILED, Phase.ABORTED])
def test_an_ended_job_never_moves_again(end: Phase) -> None:
    job = _job()
    for phase in (Phase.COMPUTING, Phase.SENDING, end):
        job.move(phase)
    for phase in Phase:
        with pytest.raises(IllegalMove):
            job.move(phase)


def test_prompt_kv_leaves_out_the_last_token_and_counts_no_cache_hit_without_a_prefix() -> None:
    job = _job(prompt_tokens=11)
    assert job.prompt_kv_tokens == 10 and job.cached_tokens == 0


class RecordingPath:
    """Stands in for an OutgoingTransfer: records what the job queues on it."""

    def __init__(self, target: KVTarget) -> None:
        self.target = target
        self.queued: list[tuple[int, int]] = []
        self.kv_bytes = 0
        self.ended = False

    async def put(self, token_start: int, kv: torch.Tensor) -> None:
        self.queued.append((token_start, token_start + kv.shape[3]))


async def test_each_path_gets_only_the_tokens_its_decoder_lacks() -> None:
    job = _job(prompt_tokens=11, targets=[KVTarget(Role.RELAY, "127.0.0.1", 1),
                                          KVTarget(Role.MAIN, "127.0.0.1", 1, token_start=6)])
    relay, main = paths = [RecordingPath(t) for t in job.request.targets]
    job.transfers = paths  # type: ignore[assignment]
    kv = torch.randn(2, 2, 1, 10, 4)
    await job.queue_kv((0, 5), kv[:, :, :, :5])
    await job.queue_kv((5, 10), kv[:, :, :, 5:])
    assert relay.queued == [(0, 5), (5, 10)]
    assert main.queued == [(6, 10)]  # MD's cache holds [0, 6)


def test_an_abort_saves_what_each_open_path_still_owed() -> None:
    job = _job(prompt_tokens=11, targets=[KVTarget(Role.RELAY, "127.0.0.1", 1),
                                          KVTarget(Role.MAIN, "127.0.0.1", 1, token_start=6)])
    relay, main = paths = [RecordingPath(t) for t in job.request.targets]
    job.transfers = paths  # type: ignore[assignment]
    relay.ended, relay.kv_bytes = True, 10 * 100
    main.kv_bytes = 1 * 100  # one of its 4 tokens crossed
    assert job.open_transfers() == [main]
    assert job.unsent_kv_bytes(main, kv_bytes_per_token=100) == 3 * 100
    assert job.unsent_kv_bytes(relay, kv_bytes_per_token=100) == 0
