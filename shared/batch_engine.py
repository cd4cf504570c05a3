"""The batch engine: one thread that runs every request's model work in shared forward passes.

Requests join and leave the running batch at every step. A step gathers the pending work (holding
briefly for work announced to arrive), admits what the KV budget has room for
(shared/kv_budget.py), takes the rows the scheduler picks (shared/scheduler.py), grows their KV,
runs ONE packed forward over them, samples (grammar masks first) and resolves each caller's asyncio
future on its own loop. asyncio code never runs a forward; it awaits futures.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from shared.config import EngineConfig
from shared.engine_futures import follow, notify
from shared.engine_timeline import EngineTimeline
from shared.errors import BadRequest, KVPreempted, PddError
from shared.grammar import Constraint, GrammarDiverged
from shared.grammar_masks import GrammarCompiler, GrammarState
from shared.kv_budget import Admission, KVBudget
from shared.model_runner import DecodeSequence, ModelRunner, PackedRow, SequenceKV
from shared.sampling import sample_rows, score_tokens
from shared.scheduler import Row, Scheduler, Scoring, StepHolds, Work

log = logging.getLogger(__name__)
T = TypeVar("T")
StepResult = tuple[int, "str | None"]
Settled = tuple[asyncio.Future, object, "BaseException | None"]  # a future, its result or its error


class NotAdmitted(PddError):
    code = "not_admitted"


@dataclass(frozen=True)
class _Command:
    """Work to run on the engine thread between steps; `label` and `key` name it in the timeline."""

    fn: Callable[[], None]
    future: asyncio.Future | None = None  # settled by fn; failed if it never runs
    label: str = ""
    key: str = ""


class _Count:
    """A count one of the engine's parts keeps, read as the engine's own (as the stats name it)."""

    def __init__(self, part: str, name: str) -> None:
        self.part = part
        self.name = name

    def __get__(self, engine: BatchEngine, owner: type) -> int:
        count: int = getattr(getattr(engine, self.part), self.name)
        return count


class BatchEngine:
    def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig(), name: str = "engine",
                 grammars: GrammarCompiler | None = None) -> None:
        """`grammars`: the model's vocabulary for constrained decoding (decoders); without it a request
        with a constraint is refused at admission."""
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.runner = runner
        self.config = config
        self.grammars = grammars
        self._cond = threading.Condition()
        self._incoming: list[Work] = []  # guarded by _cond
        # guarded by _cond: what to run between steps, and the future it settles (failed if never run)
        self._commands: deque[_Command] = deque()
        self.timeline = EngineTimeline(config.timeline_path, name) if config.timeline_path else None
        self.on_death: Callable[[BaseException], None] | None = None  # called on the engine thread if its loop dies
        self._stopping = False
        # engine-thread state
        self.scheduler = Scheduler(config)
        self.kv_budget = KVBudget(runner, config, self._prepare, self._forget, self._record)
        self._work: list[Work] = []
        self._expected: set[str] = set()  # keys served by the last step, likely to submit again
        self.steps = 0
        self.rows = 0  # requests served, summed over steps
        self.forward_s = 0.0  # time spent in forwards and sampling
        self.batch_sizes: deque[int] = deque(maxlen=256)  # requests per recent step
        self.step_holds = StepHolds(config)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # ---- asyncio side -------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests waiting for KV budget."""
        return len(self.kv_budget.waiting)

    @property
    def running(self) -> int:
        return len(self.kv_budget.slots)

    @property
    def queued(self) -> int:
        """Work not yet started: requests waiting for KV budget and steps waiting for a forward."""
        return len(self.kv_budget.waiting) + len(self._work) + len(self._incoming)

    kv_used_tokens = _Count("kv_budget", "used_tokens")  # what admitted requests allocated
    frees = _Count("kv_budget", "frees")
    grows = _Count("kv_budget", "grows")
    preemptions = _Count("kv_budget", "preemptions")
    holds = _Count("step_holds", "holds")
    holds_met = _Count("step_holds", "holds_met")
    announced = _Count("step_holds", "announced")
    announced_late = _Count("step_holds", "announced_late")

    def stats(self) -> dict[str, int | float]:
        """For the heartbeat: kv_used_tokens is what admitted requests allocated, kv_filled_tokens what they hold."""
        steps = self.steps
        return {"kv_budget_tokens": self.config.kv_budget_tokens, "kv_used_tokens": self.kv_used_tokens,
                "kv_filled_tokens": self.kv_budget.filled_tokens(), "waiting": self.waiting, "running": self.running,
                "engine_steps": steps, "mean_batch": round(self.rows / steps, 2) if steps else 0.0,
                "kv_frees": self.frees, "kv_grows": self.grows, "preemptions": self.preemptions,
                "forward_s": round(self.forward_s, 3), "holds": self.holds, "holds_met": self.holds_met,
                "announced": self.announced, "announced_late": self.announced_late, **self.runner.stats()}

    async def open(self, key: str, parts: Sequence[torch.Tensor], kv_tokens: int,
                   seq: DecodeSequence | None = None, pending_tokens: int = 0,
                   background: bool = False) -> SequenceKV:
        """Admit a request that will hold at most `kv_tokens` KV positions (waiting while the budget is
        full), filled with parts. A decoding request (`seq`) gets its parts, the `pending_tokens` that
        `fill` will add (the rest of its prompt, still arriving) and `kv_grow_tokens` more now, and
        grows as it goes; any other gets all `kv_tokens` at once. A `background` request's longer
        work goes after everyone else's (nobody waits for it).

        The caller must `release(key)` on every path once this was called, also when it was
        cancelled while waiting: the release is what frees the KV or withdraws the wait.
        """
        future = asyncio.get_running_loop().create_future()
        admission = self.kv_budget.admission(key, parts, kv_tokens, seq, pending_tokens, background, future)
        self._command(lambda: self.kv_budget.waiting.append(admission), future, "open", key)
        return await future

    def submit(self, key: str, feed_ids: list[int], sample: bool, return_kv: bool = False,
               score: Scoring | None = None, unfeed: int = 0) -> asyncio.Future:
        """Feed tokens to an admitted request's KV in the next steps.

        `unfeed`: first drop the KV of the request's newest `unfeed` positions, in the step that
        feeds (MD's cut that brings nothing new: it feeds its newest token again for its logits).

        The future's result: (token, finish_reason) when `sample` (the token's logprobs, if asked for,
        are on the DecodeSequence: last_logprob), the fed positions' KV
        [layers, 2, kv_heads, len(feed_ids), head_dim] on the CPU when `return_kv`, else None; with
        `score` (never beside `sample`), that and the fed positions' TokenLogprobs, as a pair.
        """
        return self._submit(key, feed_ids, sample, return_kv, score, unfeed).future

    async def submit_timed(self, key: str, feed_ids: list[int], sample: bool, return_kv: bool = False,
                           score: Scoring | None = None, unfeed: int = 0) -> tuple[Any, int, int]:
        """As submit: the result (its shape set by the flags, as there), and when it was submitted and its
        first forward began (time.time_ns)."""
        work = self._submit(key, feed_ids, sample, return_kv, score, unfeed)
        result = await work.future
        return result, work.submitted_ns, work.started_ns

    def _submit(self, key: str, feed_ids: list[int], sample: bool, return_kv: bool,
                score: Scoring | None = None, unfeed: int = 0) -> Work:
        if not feed_ids:
            raise ValueError("nothing to feed")
        if score is not None and (sample or len(score.next_ids) != len(feed_ids)):
            raise ValueError("scoring needs one next token per fed token, and no sampling")
        if unfeed < 0:
            raise ValueError(f"cannot unfeed {unfeed} positions")
        work = Work(key, list(feed_ids), sample, return_kv, asyncio.get_running_loop().create_future(),
                     submitted_ns=time.time_ns(), score=score, unfeed=unfeed)
        with self._cond:
            self._check_alive()
            self._incoming.append(work)
            self._cond.notify()
        return work

    async def step(self, seq: DecodeSequence, feed_ids: list[int]) -> StepResult:
        """Feed tokens and sample the next one into seq.output_ids."""
        return await self.submit(seq.request_id, feed_ids, sample=True)

    async def decode(self, seq: DecodeSequence, feed_ids: list[int]) -> list[int]:
        """Step from `feed_ids` until the request finishes: its output ids (tests and benchmarks; a
        decoder streams each token as it comes)."""
        while True:
            token, finish_reason = await self.step(seq, feed_ids)
            if finish_reason is not None:
                return seq.output_ids
            feed_ids = [token]

    async def extend(self, key: str, feed_ids: list[int]) -> None:
        """Feed tokens without sampling (a Catch-Up chunk, a prefill chunk)."""
        if feed_ids:
            await self.submit(key, feed_ids, sample=False)

    def expect(self, key: str, in_s: float) -> None:
        """Announce that an admitted request's next sampling work arrives in about `in_s` seconds (MD:
        RLD's cut is on its way). If the engine is ready to step before then, it holds the step for
        that work, at most `hold_steps` of a step, so the work joins this step instead of waiting for
        the next (feed-only work of the request already queued waits with it, and joins it in one
        row); the others' next token comes that much later, once."""
        due = time.monotonic() + max(0.0, in_s)

        def announce() -> None:
            if key in self.kv_budget.slots:
                self.step_holds.announce(key, due)

        try:
            self._command(announce, None, "expect", key)
        except NotAdmitted:
            pass

    def release(self, key: str) -> None:
        """Free a request's KV, or withdraw its wait for budget; idempotent, safe from any thread."""
        try:
            self._command(lambda: self.kv_budget.release(key), None, "release", key)
        except NotAdmitted:  # the engine stopped, and freed everything as it did
            pass

    async def fill(self, key: str, part: torch.Tensor) -> None:
        """Copy KV positions [layers, 2, kv_heads, tokens, head_dim] after an admitted request's filled
        ones, between steps: in each gap, slices of `fill_slice_bytes` for up to `fill_step_share` of a
        step's time (at least one slice), so a long prefix pauses the others' next token by a bounded
        share of a step and is in after a few steps, not one slice a step."""
        start = 0
        while True:
            start = await self.run(self._fill, key, part, start)
            if start >= part.shape[3]:
                return

    async def export(self, key: str, start: int, end: int) -> torch.Tensor:
        """A copy of positions [start, end) of a request's KV, taken between steps."""
        return await self.run(self._export, key, start, end)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args: object) -> tuple[T, int, int]:
        """Run fn on the engine thread between steps: its result, when submitted and when started (ns)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        submitted_ns = time.time_ns()

        def call() -> None:
            started_ns = time.time_ns()
            try:
                result, exc = (fn(*args), started_ns), None
            except Exception as error:
                result, exc = None, error
            notify(future, result, exc)

        self._command(call, future, getattr(fn, "__name__", "run").strip("_"),
                      args[0] if args and isinstance(args[0], str) else "")
        value, started_ns = await future
        return value, submitted_ns, started_ns

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def mark(self, key: str, what: str, **fields: object) -> None:
        """A service's own moment in the timeline (MD: a cut received), if there is one."""
        self._record("mark", t_ns=time.time_ns(), key=key, what=what, **fields)

    def _record(self, kind: str, **fields: object) -> None:
        if self.timeline is not None:
            self.timeline.write(kind, **fields)

    def _command(self, fn: Callable[[], None], future: asyncio.Future | None = None, label: str = "",
                 key: str = "") -> None:
        with self._cond:
            self._check_alive()
            self._commands.append(_Command(fn, future, label, key))
            self._cond.notify()

    def _check_alive(self) -> None:
        if self._stopping or not self._thread.is_alive():
            raise NotAdmitted("the engine has stopped")

    # ---- engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.config.torch_threads > 0:
            torch.set_num_threads(self.config.torch_threads)
        batch: list[Row] = []
        try:
            while self._gather():
                self.kv_budget.admit()
                batch = self._make_room(self._schedule())
                if batch:
                    self._run(batch)
                batch = []
        except Exception as exc:  # a bug: logged, everything waiting fails, and the service is told
            log.exception("engine loop died")
            if self.on_death is not None:
                self.on_death(exc)
            died = NotAdmitted(f"the engine stopped: {type(exc).__name__}: {exc}")
            for work, _ in batch:  # the step that failed: its work may have left the queue already
                notify(work.future, exc=died)
            self._fail_all(died)
        finally:
            self._fail_all(NotAdmitted("engine stopped"))
            if self.timeline is not None:
                self.timeline.close()

    def _gather(self) -> bool:
        """Wait for work; after a step, also briefly for the requests it served, so they step together,
        and for work announced to arrive within a hold (`expect`)."""
        deadline = time.monotonic() + self.config.gather_s
        held_since: float | None = None
        held_since_ns = 0
        held_for: set[str] = set()
        while True:
            with self._cond:
                if self._stopping:  # what is still queued fails in _fail_all
                    return False
                commands, self._commands = self._commands, deque()
                self._work += self._incoming
                self._incoming = []
            self._run_commands(commands)
            now = time.monotonic()
            have_work = bool(self._work)
            missing = {key for key in self._expected - {w.key for w in self._work} if key in self.kv_budget.slots}
            if missing and now >= deadline:
                self._expected.clear()
                missing = set()
            arrived = {w.key for w in self._work if w.sample}  # the announced work samples (MD's cut)
            hold_until = self.step_holds.until(now, held_since, arrived, self.kv_budget.slots) if have_work else None
            if have_work and not missing and hold_until is None:
                if held_since is not None:
                    met = self.step_holds.ended(held_for, arrived)
                    self._record("hold", t_ns=held_since_ns, end_ns=time.time_ns(), keys=sorted(held_for), met=met)
                return True
            if hold_until is not None and held_since is None:
                held_since, held_since_ns, held_for = now, time.time_ns(), set(self.step_holds.due)
            wake_at = min(deadline if missing else float("inf"), hold_until or float("inf"))
            with self._cond:
                if not (self._commands or self._incoming or self._stopping):
                    self._cond.wait(wake_at - now if have_work or missing else None)

    def _run_commands(self, commands: deque[_Command]) -> None:
        """What the asyncio side asked for between steps (open, fill, release, ...); then admit."""
        for command in commands:
            started_ns = time.time_ns()
            try:
                command.fn()
            except Exception:  # a command settles its own future; one that fails must not stop the engine
                log.exception("engine command failed")
            self._record("command", t_ns=started_ns, end_ns=time.time_ns(), label=command.label, key=command.key)
        if commands:
            self.kv_budget.admit()

    def _prepare(self, admission: Admission) -> None:
        """Before an admission's KV is allocated: its grammar, if it has a constraint."""
        if admission.seq is not None and admission.seq.sampling.constraint is not None:
            admission.seq.grammar = self._new_grammar(admission.seq.sampling.constraint)

    def _new_grammar(self, constraint: dict[str, str]) -> GrammarState:
        if self.grammars is None:
            raise BadRequest("this engine has no grammar support; constrained decoding runs on decoders")
        return self.grammars.new_state(Constraint.from_dict(constraint))

    def _forget(self, key: str, exc: PddError | None) -> None:
        """The KV budget freed a request: its queued work fails with `exc`, or is cancelled."""
        withdrawn = [w.future for w in self._work if w.key == key]
        self._work = [w for w in self._work if w.key != key]
        for future in withdrawn:
            notify(future, exc=exc, cancel=exc is None)
        self._expected.discard(key)
        self.step_holds.due.pop(key, None)

    def _make_room(self, batch: list[Row]) -> list[Row]:
        return self.kv_budget.make_room(batch)

    def _schedule(self) -> list[Row]:
        """The next step's rows (shared/scheduler.py), the queue tidied first: work whose request
        holds no KV fails, cancelled and finished work goes, and feed-only work joins the next."""
        for work in self._work:
            if work.key not in self.kv_budget.slots:
                self._drop(work, KVPreempted(f"{work.key} was preempted") if work.key in self.kv_budget.preempted
                           else NotAdmitted(f"{work.key} holds no KV here"))
        self._work, joined = self.scheduler.coalesce([w for w in self._work if w.left and not w.future.cancelled()])
        for work, prev in joined:
            follow(work.future, prev.future)
        schedule = self.scheduler.schedule(self._work, self.kv_budget.slots)
        for work, exc in schedule.failed:
            self._drop(work, exc)
        for work, _ in schedule.rows:
            if work.unfeed:  # first scheduled: drop the newest positions it asked to
                self.kv_budget.slots[work.key].kv.length -= work.unfeed
                work.unfeed = 0
        return schedule.rows

    @staticmethod
    def _drop(work: Work, exc: BaseException) -> None:
        """Fail a work; it leaves the queue after the step."""
        work.fed = len(work.feed_ids)
        notify(work.future, exc=exc)

    def _run(self, batch: list[Row]) -> None:
        """One packed forward over the batch; then sample, and settle the work that is complete."""
        started_ns = time.time_ns()
        for work, _ in batch:
            work.started_ns = work.started_ns or started_ns
        t0 = time.perf_counter()
        cpu0_ns = time.thread_time_ns() if self.timeline is not None else 0
        settled = self._forward(batch)
        self._work = [w for w in self._work if w.left]
        if settled is None:
            return
        self._count_step(batch, time.perf_counter() - t0, started_ns, cpu0_ns)
        for future, outcome, error in settled:
            notify(future, outcome, error)

    def _forward(self, batch: list[Row]) -> list[Settled] | None:
        """The forward, scoring and sampling: what to settle; None if the forward failed (and failed
        the step's work)."""
        rows = [PackedRow(self.kv_budget.slots[w.key].kv, w.feed_ids[w.fed:w.fed + take], w.sample and take == w.left,
                          every_logit=w.score is not None) for w, take in batch]
        scoring, sampling_rows = self._logit_rows(batch)
        try:
            logits = self.runner.forward_packed(rows)
        except Exception as exc:
            log.exception("forward over %d requests failed", len(batch))
            for work, _ in batch:
                self._drop(work, exc)
            return None
        self._expected = set()
        failed = self._score(scoring, logits)
        for work, take in batch:
            work.fed += take
        # sampling_rows: the logits of the sampling work now complete, in batch order
        sampled = [w for w, _ in batch if w.sample and not w.left]
        try:
            settled = self._sample(sampled, logits if not scoring else logits[sampling_rows])
        except Exception as exc:  # a bug in one option must not stop the engine: this step's rows fail
            log.exception("sampling %d requests failed", len(sampled))
            settled = [(work.future, None, exc) for work in sampled]
        for work, _ in batch:
            if work in failed:
                work.fed = len(work.feed_ids)
                settled.append((work.future, None, failed[work]))
            elif not work.left and not work.sample:
                kv = self.kv_budget.slots[work.key].kv
                result = kv.slice(kv.length - len(work.feed_ids), kv.length).to("cpu") if work.return_kv else None
                settled.append((work.future, result if work.score is None else (result, work.scored), None))
        return settled

    def _count_step(self, batch: list[Row], forward_s: float, started_ns: int, cpu0_ns: int) -> None:
        self.forward_s += forward_s
        self.step_holds.stepped(forward_s)
        self.steps += 1
        self.rows += len(batch)
        self.batch_sizes.append(len(batch))
        if self.timeline is not None:
            self.timeline.write("step", t_ns=started_ns, end_ns=time.time_ns(), step=self.steps,
                                cpu_ns=time.thread_time_ns() - cpu0_ns,
                                rows=[[w.key, take, w.sample and not w.left, w.submitted_ns] for w, take in batch])

    @staticmethod
    def _logit_rows(batch: list[Row]) -> tuple[list[tuple[Work, int, int]], list[int]]:
        """Where each work's logits will be: (scoring work, its first row, rows) and the sampling rows."""
        scoring: list[tuple[Work, int, int]] = []
        sampling: list[int] = []
        at = 0
        for work, take in batch:
            if work.score is not None:
                scoring.append((work, at, take))
                at += take
            elif work.sample and take == work.left:
                sampling.append(at)
                at += 1
        return scoring, sampling

    def _score(self, scoring: list[tuple[Work, int, int]], logits: torch.Tensor) -> dict[Work, Exception]:
        """Append each scoring work's logprobs for this step's tokens (before `fed` moves past them)."""
        failed: dict[Work, Exception] = {}
        for work, first, rows in scoring:
            score = work.score
            assert score is not None  # _logit_rows put only scoring work here
            try:
                work.scored += score_tokens(logits[first:first + rows],
                                            score.next_ids[work.fed:work.fed + rows], score.top_n)
            except Exception as exc:  # this request fails; the others in the step go on
                log.exception("scoring %s failed", work.key)
                failed[work] = exc
        return failed

    def _sample(self, sampled: list[Work], logits: torch.Tensor) -> list[Settled]:
        """Pick each sampling row's token (its grammar synced and applied first): what to settle."""
        seqs = [self.kv_budget.slots[w.key].seq for w in sampled]
        failed: dict[int, PddError] = {}
        grammars: dict[int, GrammarState | None] = {}
        ready_seqs: dict[int, DecodeSequence] = {}
        for i, seq in enumerate(seqs):
            if seq is None:
                failed[i] = NotAdmitted(f"{sampled[i].key} has no sampling state")
                continue
            try:
                grammars[i] = seq.synced_grammar()
            except GrammarDiverged as exc:  # this request ends; the others in the step go on
                failed[i] = exc
            else:
                ready_seqs[i] = seq
        ready = list(grammars)
        with torch.inference_mode():  # the forward's logits are inference tensors; masks change them in place
            ready_logits = logits[ready] if len(ready) < len(seqs) else logits
            if self.grammars is not None:
                self.grammars.apply_masks(ready_logits, list(grammars.values()))
            picks = dict(zip(ready, sample_rows(ready_logits, [ready_seqs[i].sampling_row() for i in ready])))
        settled: list[Settled] = []
        for i, work in enumerate(sampled):
            if i in failed:
                settled.append((work.future, None, failed[i]))
                continue
            seq = ready_seqs[i]
            result = (picks[i].token_id, seq.accept(picks[i].token_id, picks[i].logprob))
            if result[1] is None:
                self._expected.add(work.key)
            settled.append((work.future, result, None))
        return settled

    def _fill(self, key: str, part: torch.Tensor, start: int) -> int:
        """Copy part's positions from `start` on, a slice at a time, until this gap's time is spent;
        where the next gap starts."""
        slot = self.kv_budget.slots.get(key)
        if slot is None:
            raise NotAdmitted(f"{key} holds no KV here")
        tokens = part.shape[3]
        token_bytes = part[:, :, :, :1].nbytes or 1
        step = max(1, self.config.fill_slice_bytes // token_bytes) if self.config.fill_slice_bytes else tokens
        budget_s = self.config.fill_step_share * self.step_holds.step_s
        began = time.perf_counter()
        while True:
            end = min(tokens, start + step)
            self.runner.append_kv(slot.kv, part[:, :, :, start:end])  # an empty part: the admission check alone
            start = end
            if start >= tokens or time.perf_counter() - began >= budget_s:
                return start

    def _export(self, key: str, start: int, end: int) -> torch.Tensor:
        slot = self.kv_budget.slots.get(key)
        if slot is None:
            raise NotAdmitted(f"{key} holds no KV here")
        return slot.kv.slice(start, end)

    def _fail_all(self, exc: PddError) -> None:
        with self._cond:
            self._stopping = True  # nothing new comes in
            self._work += self._incoming
            self._incoming = []
            commands, self._commands = self._commands, deque()
        pending = ([w.future for w in self._work] + [a.future for a in self.kv_budget.waiting]
                   + [command.future for command in commands if command.future is not None])
        self._work, self.kv_budget.waiting = [], deque()
        for future in pending:
            notify(future, exc=exc)
        for key in list(self.kv_budget.slots):
            self.kv_budget.release(key)
