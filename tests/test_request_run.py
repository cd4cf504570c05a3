"""The gateway's RequestRun as plain logic: the merge of RLD's and MD's tokens, the cut, recovery and
migration. Decoded messages are fed in directly; its host is a fake that records what it was asked."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.gateway.run.attempt import Attempt, AttemptPhase, GenerationRequest
from services.gateway.run.request_run import RequestRun, RunPhase
from shared import subjects
from shared.config import CommonConfig, GatewayConfig
from shared.errors import DeadlineExceeded, InstanceStopping, KVPreempted, KVUnreachable, PeerGone, RequestAborted
from shared.messages import (
    Handoff,
    HandoffStats,
    MainLost,
    PrefillDone,
    RequestFailed,
    TokenChunk,
)
from shared.names import HandoffMode, Pipeline, Role
from shared.sampling_params import SamplingParams

CONFIG = GatewayConfig(
    common=CommonConfig("nats://127.0.0.1:4222", "gateway-test", "INFO", "", 1.0), model="tiny",
    host="127.0.0.1", port=0, default_pipeline="auto", request_timeout_s=10.0, token_timeout_s=5.0,
    max_body_bytes=64 * 1024, default_max_tokens=32, max_migrations=2)
PROMPT = [11, 12, 13, 14]
REQ_ID = "req-" + "0" * 32  # the KV wire carries request ids as UUIDs


class FakeDispatch:
    """The run's host: attempt n runs on p-n, rld-n and md-n, on `pipelines[n]`; what the run
    publishes (MainLost, the takeover Handoff) and counts is recorded."""

    def __init__(self, *pipelines: Pipeline, unavailable_after: int | None = None, is_alive=None,
                 on_gone=None, on_lost=None, on_recovery=None) -> None:
        self.pipelines = pipelines or (Pipeline.P_RLD_MD,)
        self.unavailable_after = unavailable_after
        self.started: list[tuple[GenerationRequest, int, set[str]]] = []
        self.stopped: list[tuple[str, str]] = []
        self.excluded: list[frozenset[str]] = []  # per migration: the instances it must not go to
        self.published: list[tuple[str, object]] = []
        self._is_alive, self._on_gone, self._on_lost, self._on_recovery = is_alive, on_gone, on_lost, on_recovery

    async def dispatch(self, run, req, output_offset, avoid, exclude=frozenset()) -> Attempt:
        if output_offset or self.started:
            self.excluded.append(exclude)
        return await self.start(req, output_offset, avoid)

    async def start(self, req, output_offset, avoid) -> Attempt:
        n = len(self.started)
        if self.unavailable_after is not None and n >= self.unavailable_after:
            raise PeerGone("no live main instance")
        self.started.append((req, output_offset, set(avoid)))
        pipeline = self.pipelines[min(n, len(self.pipelines) - 1)]
        instances = {Role.PREFILL: f"p-{n}", Role.MAIN: f"md-{n}"}
        if pipeline.uses_relay:
            instances[Role.RELAY] = f"rld-{n}"
        return Attempt(req, output_offset, pipeline, None, instances)

    async def stop(self, attempt: Attempt, reason: str) -> None:
        self.stopped.append((attempt.request_id, reason))

    def is_alive(self, instance_id: str) -> bool:
        return self._is_alive is None or self._is_alive(instance_id)

    def instance_gone(self, instance_id: str) -> None:
        if self._on_gone is not None:
            self._on_gone(instance_id)

    async def publish(self, subject: str, message: object) -> None:
        self.published.append((subject, message))

    async def answer_grew(self, attempt: Attempt, token_ids: list[int]) -> None:
        pass

    def count_loss(self, tier: Role, how: str) -> None:
        if self._on_lost is not None:
            self._on_lost(tier, how)

    def count_recovery(self, action: str) -> None:
        if self._on_recovery is not None:
            self._on_recovery(action)


async def start_run(dispatch: FakeDispatch, max_tokens: int = 20, config: GatewayConfig = CONFIG,
                    is_alive=None) -> tuple[RequestRun, FakeDispatch]:
    dispatch._is_alive = is_alive or dispatch._is_alive
    req = GenerationRequest(REQ_ID, list(PROMPT), SamplingParams(max_tokens=max_tokens), None, None, 0.0)
    run = RequestRun(req, config, dispatch)
    await run.start()
    return run, dispatch


def chunk(run: RequestRun, start: int, ids: list[int], tier: Role, finish: str | None = None) -> TokenChunk:
    return TokenChunk(run.attempt.request_id, start, ids, tier, finish)


def failed(run: RequestRun, tier: Role, code: str = PeerGone.code) -> RequestFailed:
    return RequestFailed(run.attempt.request_id, tier, code, f"{tier} went away")


async def feed(run: RequestRun, *events: object) -> list[tuple[int, int, str]]:
    out = []
    for event in events:
        out += [(t.index, t.token_id, t.tier) for t in await run.handle(event)]
    return out


# --- the merge -------------------------------------------------------------------------------


async def test_tokens_ahead_of_a_gap_wait_for_it_and_come_out_in_order():
    run, _ = await start_run(FakeDispatch())
    assert await feed(run, chunk(run, 2, [102, 103], Role.RELAY)) == []
    assert await feed(run, chunk(run, 0, [100], Role.RELAY)) == [(0, 100, "relay")]
    assert await feed(run, chunk(run, 1, [101], Role.RELAY)) == [(1, 101, "relay"), (2, 102, "relay"),
                                                                  (3, 103, "relay")]
    assert run.token_ids == [100, 101, 102, 103] and run.first_token_at is not None


async def test_an_index_sent_by_both_relay_and_main_reaches_the_client_once():
    run, _ = await start_run(FakeDispatch())
    await feed(run, chunk(run, 0, [100, 101, 102], Role.RELAY))
    merged = await feed(run, chunk(run, 2, [102, 103], Role.MAIN), chunk(run, 2, [102, 103, 104], Role.RELAY),
                        chunk(run, 3, [103], Role.MAIN))
    assert merged == [(3, 103, "main"), (4, 104, "relay")]
    assert run.token_ids == [100, 101, 102, 103, 104]


async def test_the_cut_is_decided_once_from_the_handoff_stats():
    run, _ = await start_run(FakeDispatch())
    await feed(run, chunk(run, 0, [100, 101, 102], Role.RELAY))
    assert run.cut_index is None and run.attempt.phase is AttemptPhase.DISPATCHED
    stats = HandoffStats(run.attempt.request_id, 3, 0.2, 0.01, 0.003)
    await feed(run, stats, chunk(run, 3, [103], Role.MAIN), HandoffStats(run.attempt.request_id, 9, 0, 0, 0))
    assert run.cut_index == 3 and run.handoff == stats and run.attempt.phase is AttemptPhase.CUT


async def test_mains_first_token_marks_the_cut_when_its_stats_are_late():
    run, _ = await start_run(FakeDispatch())
    await feed(run, chunk(run, 0, [100, 101], Role.RELAY), chunk(run, 2, [102], Role.MAIN))
    assert run.cut_index == 2 and run.attempt.phase is AttemptPhase.CUT


async def test_p_md_has_no_cut():
    run, _ = await start_run(FakeDispatch(Pipeline.P_MD))
    await feed(run, chunk(run, 0, [100, 101], Role.MAIN))
    assert run.cut_index is None and run.attempt.phase is AttemptPhase.DISPATCHED


async def test_a_finish_reason_finishes_the_run_and_later_tokens_are_dropped():
    dispatch = FakeDispatch()
    run, _ = await start_run(dispatch)
    merged = await feed(run, chunk(run, 1, [101, 102], Role.MAIN, "length"), chunk(run, 0, [100], Role.RELAY))
    assert [i for i, _, _ in merged] == [0, 1, 2] and run.finish_reason == "length"
    assert run.phase is RunPhase.FINISHED and run.finished
    assert await feed(run, chunk(run, 3, [103], Role.MAIN)) == []
    await run.close("error")
    await run.close("error")
    assert run.phase is RunPhase.CLOSED and run.finished, "closing keeps what the run became"
    assert dispatch.stopped == [(REQ_ID, "finished")]


async def test_a_closed_run_is_let_go_with_the_callers_reason():
    dispatch = FakeDispatch()
    run, _ = await start_run(dispatch)
    await run.close("client_disconnected")
    assert dispatch.stopped == [(REQ_ID, "client_disconnected")]
    assert run.attempt.phase is AttemptPhase.STOPPED and not run.finished


async def test_prefill_done_is_recorded_on_the_attempt():
    run, _ = await start_run(FakeDispatch())
    done = PrefillDone(run.attempt.request_id, "p-0", 4, 0.1, {"relay": 10}, {"relay": 0.01})
    await feed(run, done)
    assert run.attempt.prefill == done == run.prefill
    # P lost once its KV is out: nothing to do
    await feed(run, chunk(run, 0, [100], Role.RELAY), failed(run, Role.PREFILL))
    assert run.recovery is None and run.phase is RunPhase.RUNNING


# --- recovery without migration ------------------------------------------------------------


async def test_relay_lost_before_the_cut_main_takes_over_with_every_streamed_token_at_once():
    run, nc = await start_run(FakeDispatch())
    await feed(run, chunk(run, 0, [100, 101, 102, 103], Role.RELAY), failed(run, Role.RELAY))
    assert run.recovery == "main_takes_over" and run.cut_index == 4 and run.attempt.phase is AttemptPhase.CUT
    subject, handoff = nc.published[-1]
    assert subject == subjects.handoff("md-0")
    assert handoff == Handoff(REQ_ID, [100, 101, 102, 103], finished=False, start=0, final=True,
                              mode=HandoffMode.ONE_SHOT)
    assert await feed(run, chunk(run, 4, [104], Role.MAIN)) == [(4, 104, "main")]
    assert run.cut_index == 4, "decided once"


async def test_main_lost_before_the_cut_leaves_relay_alone_and_is_counted_once():
    recoveries = []
    dispatch = nc = FakeDispatch(on_recovery=recoveries.append)
    req = GenerationRequest(REQ_ID, list(PROMPT), SamplingParams(max_tokens=20), None, None, 0.0)
    run = RequestRun(req, CONFIG, dispatch)
    await run.start()
    await feed(run, chunk(run, 0, [100], Role.RELAY), failed(run, Role.PREFILL))  # MD's KV may never come
    assert nc.published == [(subjects.main_lost("rld-0"), MainLost(REQ_ID, "prefill: prefill went away"))]
    assert run.attempt.phase is AttemptPhase.RELAY_ALONE
    await feed(run, failed(run, Role.MAIN))  # MD, let go, reports its KV never came
    assert recoveries == ["finish_on_relay"] and len(nc.published) == 1 and not dispatch.stopped


# --- migration -------------------------------------------------------------------------------


async def test_a_migration_continues_after_the_streamed_tokens_on_other_instances():
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_MD)
    run, _ = await start_run(dispatch, max_tokens=20)
    first_id = run.attempt.request_id
    await feed(run, chunk(run, 0, [100, 101, 102], Role.MAIN), failed(run, Role.MAIN))
    assert dispatch.stopped == [(first_id, "migrated")]
    moved, offset, avoid = dispatch.started[1]
    assert moved.prompt_ids == [*PROMPT, 100, 101, 102] and moved.sampling.max_tokens == 17
    assert offset == 3 and avoid == {"md-0"} and moved.request_id != first_id
    assert run.recovery == "migrate" and run.migrations[0].after_tokens == 3
    assert run.migrations[0].lost == "main" and run.instances["main"] == "md-1"
    # the new attempt's indices are its own: its token 0 is the request's token 3
    assert await feed(run, chunk(run, 0, [103], Role.MAIN)) == [(3, 103, "main")]


async def test_events_of_an_attempt_let_go_are_dropped():
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_MD)
    run, _ = await start_run(dispatch)
    old = run.attempt
    await feed(run, chunk(run, 0, [100], Role.MAIN), failed(run, Role.MAIN))
    assert old.phase is AttemptPhase.STOPPED
    late = [TokenChunk(old.request_id, 1, [999], Role.MAIN), RequestFailed(old.request_id, Role.PREFILL, "x", "y"),
            HandoffStats(old.request_id, 1, 0, 0, 0)]
    assert await feed(run, *late) == [] and len(run.migrations) == 1 and run.cut_index is None
    assert await feed(run, chunk(run, 0, [101], Role.MAIN)) == [(1, 101, "main")]


async def test_lost_instances_are_avoided_by_every_later_attempt():
    dispatch = FakeDispatch(Pipeline.P_MD)
    run, _ = await start_run(dispatch)
    await feed(run, failed(run, Role.MAIN))
    await feed(run, chunk(run, 0, [100], Role.MAIN), failed(run, Role.MAIN))
    assert [avoid for _, _, avoid in dispatch.started] == [set(), {"md-0"}, {"md-0", "md-1"}]
    assert [offset for _, offset, _ in dispatch.started] == [0, 0, 1]


async def test_an_aborted_code_does_not_blame_the_instance():
    dispatch = FakeDispatch(Pipeline.P_MD)
    run, _ = await start_run(dispatch)
    await feed(run, failed(run, Role.MAIN, RequestAborted.code))
    assert dispatch.started[1][2] == set() and len(run.migrations) == 1


async def test_an_instance_that_says_it_is_stopping_is_dropped_before_the_migration_picks_again():
    """Else, answering pings for a moment longer, the only MD would look busy and get the request back."""
    order: list[str] = []
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_RLD, on_gone=lambda instance: order.append(instance),
                            on_lost=lambda tier, how: order.append(f"{tier} {how}"))
    started = dispatch.start

    async def start(*args):
        order.append("dispatch")
        return await started(*args)

    dispatch.start = start
    req = GenerationRequest(REQ_ID, list(PROMPT), SamplingParams(max_tokens=20), None, None, 0.0)
    run = RequestRun(req, CONFIG, dispatch)
    await run.start()
    await feed(run, failed(run, Role.MAIN, InstanceStopping.code))
    assert order == ["dispatch", "md-0", "main gone", "dispatch"] and len(run.migrations) == 1
    # P's report of a path it sends KV on says nothing of that path's instance, whatever the code
    await feed(run, RequestFailed(run.attempt.request_id, Role.PREFILL, InstanceStopping.code, "P stops",
                                  path=Role.RELAY))
    assert "rld-1" not in order and order[-2:] == ["relay failed", "dispatch"]


async def test_migrations_stop_at_the_limit():
    dispatch = FakeDispatch(Pipeline.P_MD)
    run, _ = await start_run(dispatch, config=dataclasses.replace(CONFIG, max_migrations=1))
    await feed(run, failed(run, Role.MAIN))
    with pytest.raises(PeerGone, match="main went away"):
        await feed(run, failed(run, Role.MAIN))
    assert run.phase is RunPhase.FAILED and len(dispatch.started) == 2


async def test_no_instance_to_move_to_fails_the_run():
    dispatch = FakeDispatch(Pipeline.P_MD, unavailable_after=1)
    run, _ = await start_run(dispatch)
    with pytest.raises(PeerGone, match="could not move the request"):
        await feed(run, failed(run, Role.MAIN))
    assert run.phase is RunPhase.FAILED


async def test_the_fail_policy_fails_the_run_at_the_first_loss():
    dispatch = FakeDispatch()
    run, _ = await start_run(dispatch, config=dataclasses.replace(CONFIG, failure_policy="fail"))
    with pytest.raises(PeerGone):
        await feed(run, failed(run, Role.MAIN))
    assert run.phase is RunPhase.FAILED and len(dispatch.started) == 1


async def test_a_preempted_request_restarts_on_the_same_decoder_under_any_policy_and_limit():
    """Preemption is load, not a fault: the decoder that preempted stays preferred, the fail policy
    and --max-migrations do not apply, and the restart continues after the streamed tokens."""
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_MD, Pipeline.P_MD)
    config = dataclasses.replace(CONFIG, failure_policy="fail", max_migrations=0)
    run, _ = await start_run(dispatch, config=config)
    await feed(run, chunk(run, 0, [100, 101], Role.MAIN), failed(run, Role.MAIN, KVPreempted.code))
    await feed(run, failed(run, Role.MAIN, KVPreempted.code))
    assert [avoid for _, _, avoid in dispatch.started[1:]] == [set(), set()]
    assert [m.preempted for m in run.migrations] == [True, True] and run.phase is RunPhase.RUNNING
    moved, offset, _ = dispatch.started[2]
    assert moved.prompt_ids == [*PROMPT, 100, 101] and offset == 2
    with pytest.raises(PeerGone):  # a real failure still meets the policy
        await feed(run, failed(run, Role.MAIN))


# --- P cannot reach a decoder's KV port (issue 43) ------------------------------------------------


def unreachable(run: RequestRun, path: Role) -> RequestFailed:
    return RequestFailed(run.attempt.request_id, Role.PREFILL, KVUnreachable.code,
                         f"KV send to {path} failed: decoder refused: 64 KV connections open", path=path)


async def test_p_failing_to_reach_a_decoder_moves_the_request_off_it_without_calling_it_dead_or_failed():
    events: list[str] = []
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_RLD, on_gone=events.append,
                            on_lost=lambda tier, how: events.append(f"{tier} {how}"))
    run, _ = await start_run(dispatch)
    await feed(run, unreachable(run, Role.MAIN))
    assert events == ["main unreachable"], "not gone, not failed: the path failed"
    assert dispatch.excluded == [frozenset({"md-0"})], "the migration never goes back to it"
    assert dispatch.started[1][2] == set(), "later attempts do not hold it against the decoder"
    assert len(run.migrations) == 1 and run.pipeline == "p-rld"


async def test_p_failing_to_reach_a_decoder_that_already_streams_changes_nothing():
    dispatch = FakeDispatch(Pipeline.P_MD)
    run, _ = await start_run(dispatch)
    await feed(run, chunk(run, 0, [100], Role.MAIN), unreachable(run, Role.MAIN))
    assert len(dispatch.started) == 1 and run.recovery is None and not run.attempt.lost
    assert await feed(run, chunk(run, 1, [101], Role.MAIN)) == [(1, 101, "main")]


async def test_a_migration_never_goes_back_to_the_instance_that_just_failed():
    dispatch = FakeDispatch(Pipeline.P_MD)
    run, _ = await start_run(dispatch)
    await feed(run, failed(run, Role.MAIN, DeadlineExceeded.code))
    await feed(run, failed(run, Role.MAIN, RequestAborted.code))  # it let the request go: not at fault
    assert dispatch.excluded == [frozenset({"md-0"}), frozenset()]


# --- what the response reports --------------------------------------------------------------


async def named(dispatch: FakeDispatch, pipeline: Pipeline) -> RequestRun:
    req = GenerationRequest(REQ_ID, list(PROMPT), SamplingParams(max_tokens=20), pipeline, None, 0.0)
    run = RequestRun(req, CONFIG, dispatch)
    await run.start()
    return run


async def test_a_retry_reports_the_pipeline_that_served_it_and_each_attempts():
    """Issue 43: requests that named P-RLD-MD, retried as P-MD after P's loss, still said p-rld-md."""
    run = await named(FakeDispatch(Pipeline.P_RLD_MD, Pipeline.P_MD), Pipeline.P_RLD_MD)
    await feed(run, failed(run, Role.PREFILL))  # before any token: the request is dispatched again
    await feed(run, chunk(run, 0, [100, 101], Role.MAIN, "length"))
    summary = run.summary()
    assert summary["pipeline"] == "p-md" and summary["pipeline_requested"] == "p-rld-md"
    assert [(a["pipeline"], a["after_tokens"]) for a in summary["attempts"]] == [("p-rld-md", 0), ("p-md", 0)]
    assert summary["migrations"][0]["pipeline"] == "p-md"


async def test_relay_finishing_alone_is_reported_as_p_rld():
    run = await named(FakeDispatch(Pipeline.P_RLD_MD), Pipeline.P_RLD_MD)
    await feed(run, chunk(run, 0, [100], Role.RELAY))
    assert run.pipeline == "p-rld-md"
    await feed(run, failed(run, Role.MAIN), chunk(run, 1, [101], Role.RELAY, "length"))
    summary = run.summary()
    assert summary["recovery"] == "finish_on_relay" and summary["pipeline"] == "p-rld"
    assert [a["pipeline"] for a in summary["attempts"]] == ["p-rld"] and summary["pipeline_requested"] == "p-rld-md"
    await run.close("finished")
    assert run.summary()["pipeline"] == "p-rld", "still so once the attempt is let go"


async def test_a_request_that_names_no_pipeline_reports_none_requested():
    run, _ = await start_run(FakeDispatch(Pipeline.P_MD))
    assert run.summary()["pipeline_requested"] is None and run.summary()["pipeline"] == "p-md"


# --- the event loop: delivered events, the watchdog ---------------------------------------


async def test_the_token_stream_reads_the_wire_and_the_watchdog_migrates_off_a_dead_instance():
    dead: set[str] = set()
    dispatch = FakeDispatch(Pipeline.P_MD, Pipeline.P_MD)
    run, _ = await start_run(dispatch, is_alive=lambda instance_id: instance_id not in dead)

    async def wire(event: object) -> None:
        run.deliver(event)

    first_id = run.attempt.request_id
    await wire(chunk(run, 0, [100, 101], Role.MAIN))
    stream = run.tokens()
    assert [(await anext(stream)).index for _ in range(2)] == [0, 1]
    dead.add("md-0")  # its ping found nobody: a watchdog check moves the request, no deadline needed
    next_token = asyncio.create_task(anext(stream))
    async with asyncio.timeout(2):
        while len(dispatch.started) < 2:
            await asyncio.sleep(0.01)
    assert dispatch.started[1][1] == 2 and dispatch.started[1][2] == {"md-0"}
    await wire(TokenChunk(first_id, 2, [999], Role.MAIN))  # the dead attempt's, late: dropped
    await wire(chunk(run, 0, [102], Role.MAIN, "stop"))
    async with asyncio.timeout(2):
        event = await next_token
    assert (event.index, event.token_id, event.finish_reason) == (2, 102, "stop")
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_waiting_for_prefill_is_not_a_stall_but_silence_after_it_is():
    """A request queued at P gets no event for longer than the next-token deadline and does not
    fail; once P has sent its KV (or a token came), silence past the deadline fails it."""
    config = dataclasses.replace(CONFIG, token_timeout_s=0.3)
    run, _ = await start_run(FakeDispatch(Pipeline.P_MD), config=config)
    stream = run.tokens()
    next_token = asyncio.create_task(anext(stream))
    await asyncio.sleep(1.0)  # over three next-token deadlines, all in P's queue
    assert not next_token.done() and run.waiting_for_prefill
    run.deliver(PrefillDone(run.attempt.request_id, "p-0", len(PROMPT) - 1, 0.9, {"main": 100}, {"main": 0.01}))
    async with asyncio.timeout(3):
        await asyncio.sleep(0.05)
        assert not run.waiting_for_prefill
        with pytest.raises(DeadlineExceeded, match="no token came within 0.3s"):
            await next_token


async def test_the_next_token_deadline_runs_between_tokens():
    config = dataclasses.replace(CONFIG, token_timeout_s=0.3)
    run, _ = await start_run(FakeDispatch(Pipeline.P_MD), config=config)
    run.deliver(chunk(run, 0, [100], Role.MAIN))
    stream = run.tokens()
    assert (await anext(stream)).index == 0
    assert not run.waiting_for_prefill  # a token came: P's KV is in somewhere
    async with asyncio.timeout(3):
        with pytest.raises(DeadlineExceeded, match="no token came within"):
            await anext(stream)


# --- the lifecycle is explicit -----------------------------------------------------------------


async def test_illegal_attempt_moves_fail_loudly():
    run, _ = await start_run(FakeDispatch())
    await run.close("cancelled")
    with pytest.raises(RuntimeError, match="stopped -> cut"):
        run.attempt.move(AttemptPhase.CUT)


def test_a_request_id_the_kv_wire_cannot_carry_is_refused_at_once():
    """An id that is not 'req-' and a UUID would only fail on P's KV sockets, and the request hang."""
    with pytest.raises(ValueError, match="UUID"):
        GenerationRequest(REQ_ID + "-1", list(PROMPT), SamplingParams(max_tokens=4), None, None, 0.0)
