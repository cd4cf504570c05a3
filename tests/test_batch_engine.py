"""The batch engine on the tiny model: batched decoding is token-exact against each request's own
greedy `generate`, extend-decode fits into shared steps, the KV budget queues admissions, a
decoding request's KV grows as it goes and the newest request is preempted when growth does not
fit, and every request's KV is freed exactly once."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from shared.batch_engine import BatchEngine, KVPreempted, NotAdmitted
from shared.config import EngineConfig
from shared.engine_timeline import read_timeline
from shared.kv_budget import KVBudgetExceeded
from shared.model_runner import DecodeSequence, ModelRunner, PackedRow
from shared.models import load_model
from shared.sampling import sample_token, sample_tokens
from shared.sampling_params import SamplingParams

from helpers import engine_with


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    return ModelRunner(load_model(tiny_path, "float32", "cpu"))


@pytest.fixture(scope="module")
def prompts(runner) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(runner.config.vocab_size) for _ in range(n)] for n in (2, 5, 13, 31, 8, 57, 20, 3)]


def prompt_kv(runner: ModelRunner, prompt_ids: list[int]) -> list[torch.Tensor]:
    """What P would send: the KV of every prompt token but the last, computed alone."""
    if len(prompt_ids) < 2:
        return []
    kv = runner.new_kv(len(prompt_ids) - 1)
    runner.forward(kv, prompt_ids[:-1])
    return [kv.slice(0, kv.length)]


def sequence(runner: ModelRunner, key: str, prompt_ids: list[int], max_tokens: int) -> DecodeSequence:
    sampling = SamplingParams(max_tokens=max_tokens, eos_token_ids=(runner.config.eos_token_id,))
    return DecodeSequence(key, prompt_ids, sampling, runner.max_context_tokens)


async def decode_on(engine: BatchEngine, seq: DecodeSequence, token: int, finish_reason: str | None) -> None:
    """Step a request until it finishes, from its newest token."""
    while finish_reason is None:
        token, finish_reason = await engine.step(seq, [token])


async def decode(engine: BatchEngine, seq: DecodeSequence, parts: list[torch.Tensor],
                 eager_ids: list[int] = (), started: asyncio.Event | None = None) -> list[int]:
    """A decoder's life for one request: admission, (extend-)decode to the end, release."""
    try:
        await engine.open(seq.request_id, parts, seq.kv_tokens_needed, seq)
    except BaseException:
        engine.release(seq.request_id)
        raise
    if started is not None:
        started.set()
    return await decode_admitted(engine, seq, eager_ids)


async def test_requests_joining_and_leaving_at_different_steps_match_generate(runner, prompts, tiny_generate):
    max_tokens = [24, 5, 17, 30, 9, 12, 21, 3]
    with engine_with(runner) as engine:
        seqs = [sequence(runner, f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]

        async def join_later(i: int) -> list[int]:
            await wait_for_steps(engine, 2 * i)  # request i joins at about step 2i
            return await decode(engine, seqs[i], prompt_kv(runner, prompts[i]))

        outputs = await asyncio.gather(*(join_later(i) for i in range(len(seqs))))
        for prompt_ids, n, output in zip(prompts, max_tokens, outputs):
            assert output == tiny_generate(prompt_ids, n), f"prompt of {len(prompt_ids)} tokens"
        assert max(engine.batch_sizes) >= 4, "requests must have shared steps"
        assert len(set(engine.batch_sizes)) >= 3, "the batch must have grown and shrunk"
        assert engine.stats()["kv_used_tokens"] == 0 and engine.running == 0


async def test_a_request_admitted_with_its_prefix_takes_the_rest_by_fill(runner, prompts, tiny_generate):
    """MD's path: admitted with room for the whole prompt's KV, the DRC's prefix filled in (piece by
    piece, a few positions between two steps), the rest once it crossed; the decode is token-exact
    and nothing grew to take it."""
    prompt_ids = prompts[5]
    kv = prompt_kv(runner, prompt_ids)[0]
    pieces, rest = [kv[:, :, :, :20], kv[:, :, :, 20:40]], kv[:, :, :, 40:]
    with engine_with(runner, kv_grow_tokens=4, fill_slice_bytes=7 * kv[:, :, :, :1].nbytes) as engine:
        seq = sequence(runner, "md", prompt_ids, 12)
        admitted = await engine.open(seq.request_id, pieces[:1], seq.kv_tokens_needed, seq, 20 + rest.shape[3])
        assert admitted.length == 20 and admitted.capacity == len(prompt_ids) - 1 + 4
        await engine.fill(seq.request_id, pieces[1])
        assert admitted.length == 40
        await engine.fill(seq.request_id, rest)  # 16 positions: slices of 7, 7, 2
        assert admitted.length == len(prompt_ids) - 1
        assert await decode_admitted(engine, seq) == tiny_generate(prompt_ids, 12)
        with pytest.raises(NotAdmitted):
            await engine.fill("unknown", rest)


@pytest.mark.parametrize("share, copies", [(0.0, 16), (1e6, 1)])
async def test_a_fill_copies_slices_for_its_share_of_a_step(runner, prompts, tiny_generate, tmp_path, share, copies):
    """Between two steps a fill copies slices for up to `fill_step_share` of a step's time, at least
    one: with no share, one slice a gap (16 for 16 positions, as MD's DRC prefix took one 4 MiB slice
    a step); with a step's worth, the whole part in the first gap. Token-exact either way."""
    prompt_ids = prompts[5]
    kv = prompt_kv(runner, prompt_ids)[0]
    head, rest = kv[:, :, :, :-16], kv[:, :, :, -16:]
    path = tmp_path / "timeline.jsonl"
    with engine_with(runner, kv_grow_tokens=4, fill_slice_bytes=kv[:, :, :, :1].nbytes, fill_step_share=share,
                     timeline_path=str(path)) as engine:
        warm = sequence(runner, "warm", prompts[0], 3)  # a step's time known: the budget is a share of it
        await engine.open(warm.request_id, prompt_kv(runner, prompts[0]), warm.kv_tokens_needed, warm)
        await decode_admitted(engine, warm)
        seq = sequence(runner, "md", prompt_ids, 12)
        await engine.open(seq.request_id, [head], seq.kv_tokens_needed, seq, len(prompt_ids) - 1)
        await engine.fill(seq.request_id, rest)
        assert await decode_admitted(engine, seq) == tiny_generate(prompt_ids, 12)
    fills = [e for e in read_timeline(path) if e["kind"] == "command" and e["label"] == "fill"]
    assert len(fills) == copies


async def decode_admitted(engine: BatchEngine, seq: DecodeSequence, eager_ids: list[int] = ()) -> list[int]:
    """An admitted request's (extend-)decode to the end, then its release."""
    try:
        seq.output_ids.extend(eager_ids)
        return await engine.decode(seq, [seq.prompt_ids[-1], *eager_ids])
    finally:
        engine.release(seq.request_id)


async def wait_for_steps(engine: BatchEngine, steps: int) -> None:
    while engine.steps < steps:
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("max_batch_tokens", [512, 6])
async def test_extend_decode_inside_a_batch_is_token_exact(runner, prompts, tiny_generate, max_batch_tokens):
    """MD's takeover feeds the last prompt token plus RLD's eager tokens in one step, beside plain decodes;
    a small token budget splits the extend across steps."""
    max_tokens = 28
    with engine_with(runner, max_batch_tokens=max_batch_tokens) as engine:
        expected = [tiny_generate(p, max_tokens) for p in prompts]
        runs = []
        for i, prompt_ids in enumerate(prompts):
            eager = expected[i][:(3 * i) % 20] if i % 2 else []  # odd requests take over after 0..19 tokens
            if len(eager) >= len(expected[i]):
                eager = expected[i][:-1]
            seq = sequence(runner, f"x{i}", prompt_ids, max_tokens)
            runs.append(decode(engine, seq, prompt_kv(runner, prompt_ids), eager))
        outputs = await asyncio.gather(*runs)
        assert outputs == expected
        assert max(engine.batch_sizes) >= 4


async def test_catch_up_chunks_extend_the_kv_without_sampling(runner, prompts, tiny_generate):
    prompt_ids, max_tokens = prompts[3], 30
    expected = tiny_generate(prompt_ids, max_tokens)
    with engine_with(runner) as engine:
        seq = sequence(runner, "catch-up", prompt_ids, max_tokens)
        other = sequence(runner, "other", prompts[5], max_tokens)
        background = asyncio.create_task(decode(engine, other, prompt_kv(runner, prompts[5])))
        try:
            await engine.open(seq.request_id, prompt_kv(runner, prompt_ids), seq.kv_tokens_needed, seq)
            pending = [prompt_ids[-1]]
            for chunk in (expected[0:6], expected[6:9], expected[9:15]):  # RLD's Catch-Up chunks
                seq.output_ids.extend(chunk)
                pending += chunk
                assert await engine.extend(seq.request_id, pending[:-1]) is None
                pending = pending[-1:]
            token, finish_reason = await engine.step(seq, pending)
            await decode_on(engine, seq, token, finish_reason)
        finally:
            engine.release(seq.request_id)
        assert seq.output_ids == expected
        assert await background == tiny_generate(prompts[5], max_tokens)


async def test_a_token_fed_again_after_unfeeding_its_kv_gives_the_same_continuation(runner, prompts, tiny_generate):
    """MD's Catch-Up passes feed every token they adopt; a cut that brings nothing new drops the
    newest token's KV and feeds it again in the step that samples: the continuation is unchanged."""
    prompt_ids, max_tokens = prompts[3], 24
    expected = tiny_generate(prompt_ids, max_tokens)
    with engine_with(runner) as engine:
        seq = sequence(runner, "refeed", prompt_ids, max_tokens)
        other = sequence(runner, "other", prompts[5], max_tokens)
        background = asyncio.create_task(decode(engine, other, prompt_kv(runner, prompts[5])))
        try:
            kv = await engine.open(seq.request_id, prompt_kv(runner, prompt_ids), seq.kv_tokens_needed, seq)
            seq.output_ids.extend(expected[:7])
            await engine.extend(seq.request_id, [prompt_ids[-1]] + expected[:7])
            assert kv.length == len(prompt_ids) + 7
            token, finish_reason = await engine.submit(seq.request_id, [expected[6]], sample=True, unfeed=1)
            assert kv.length == len(prompt_ids) + 7
            await decode_on(engine, seq, token, finish_reason)
        finally:
            engine.release(seq.request_id)
        assert seq.output_ids == expected
        assert await background == tiny_generate(prompts[5], max_tokens)


async def test_unfeeding_more_than_the_kv_holds_fails_that_work_only(runner, prompts, tiny_generate):
    prompt_ids = prompts[0]
    with engine_with(runner) as engine:
        seq = sequence(runner, "short", prompt_ids, 4)
        kv = await engine.open(seq.request_id, prompt_kv(runner, prompt_ids), seq.kv_tokens_needed, seq)
        try:
            with pytest.raises(ValueError, match="cannot unfeed 5"):
                await engine.submit(seq.request_id, [prompt_ids[-1]], sample=True, unfeed=5)
            assert kv.length == len(prompt_ids) - 1, "the KV is as it was"
            with pytest.raises(ValueError, match="cannot unfeed -1"):
                engine.submit(seq.request_id, [prompt_ids[-1]], sample=True, unfeed=-1)
            token, _ = await engine.step(seq, [prompt_ids[-1]])
            assert token == tiny_generate(prompt_ids, 4)[0]
        finally:
            engine.release(seq.request_id)


@contextmanager
def engine_paused(engine: BatchEngine):
    """Hold the engine thread between steps (a command that blocks), so work queues up meanwhile."""
    gate = threading.Event()
    paused = asyncio.ensure_future(engine.run(gate.wait, 10))
    try:
        yield
    finally:
        gate.set()
        paused.cancel()


@pytest.mark.parametrize("cut_brings_a_token", [True, False])
async def test_a_requests_queued_feed_only_work_joins_its_next_work_in_one_row(runner, prompts, tiny_generate,
                                                                             cut_brings_a_token):
    """MD's Catch-Up passes still queued when the cut's pass comes run with it, as one row in one
    step, and each future settles. A cut that brings nothing new drops its newest token's KV and
    feeds it again: joined to a queued pass that feeds that token, the token is fed once. The
    continuation is token-exact."""
    prompt_ids, max_tokens = prompts[3], 16
    expected = tiny_generate(prompt_ids, max_tokens)
    with engine_with(runner) as engine:
        seq = sequence(runner, "joined", prompt_ids, max_tokens)
        kv = await engine.open("joined", prompt_kv(runner, prompt_ids), seq.kv_tokens_needed, seq)
        try:
            seq.output_ids.extend(expected[:6])
            with engine_paused(engine):
                await asyncio.sleep(0.05)
                passes = [engine.submit("joined", [prompt_ids[-1]] + expected[:3], sample=False),
                          engine.submit("joined", expected[3:6], sample=False)]
                if cut_brings_a_token:
                    seq.output_ids.append(expected[6])
                    cut = engine.submit("joined", [expected[6]], sample=True)
                else:
                    cut = engine.submit("joined", [expected[5]], sample=True, unfeed=1)
                steps = engine.steps
            token, finish_reason = await cut
            assert [await p for p in passes] == [None, None]
            assert engine.steps == steps + 1, "one step for the three"
            assert kv.length == len(prompt_ids) + len(seq.output_ids) - 1
            await decode_on(engine, seq, token, finish_reason)
        finally:
            engine.release("joined")
        assert seq.output_ids == expected


async def test_a_requests_work_runs_in_order_even_when_it_cannot_be_joined(runner, prompts, tiny_generate):
    """Work that returns its KV is not joined; the request's next (a one-token decode, which the
    scheduler favours) still waits for it."""
    prompt_ids, max_tokens = prompts[5], 10
    expected = tiny_generate(prompt_ids, max_tokens)
    with engine_with(runner) as engine:
        seq = sequence(runner, "ordered", prompt_ids, max_tokens)
        await engine.open("ordered", prompt_kv(runner, prompt_ids), seq.kv_tokens_needed, seq)
        try:
            seq.output_ids.extend(expected[:4])
            with engine_paused(engine):
                await asyncio.sleep(0.05)
                kv_future = engine.submit("ordered", [prompt_ids[-1]] + expected[:3], sample=False, return_kv=True)
                step = engine.submit("ordered", [expected[3]], sample=True)
            token, finish_reason = await step
            assert (await kv_future).shape[3] == 4
            await decode_on(engine, seq, token, finish_reason)
        finally:
            engine.release("ordered")
        assert seq.output_ids == expected


async def test_full_kv_budget_makes_new_requests_wait_then_run(runner, prompts, tiny_generate):
    max_tokens = 16
    seqs = [sequence(runner, f"b{i}", prompts[i], max_tokens) for i in range(3)]
    budget = seqs[0].kv_tokens_needed + seqs[1].kv_tokens_needed  # room for the first two only
    with engine_with(runner, kv_budget_tokens=budget) as engine:
        started = [asyncio.Event() for _ in seqs]
        first_two = [asyncio.create_task(decode(engine, seqs[i], prompt_kv(runner, prompts[i]), started=started[i]))
                     for i in range(2)]
        await asyncio.gather(started[0].wait(), started[1].wait())
        third = asyncio.create_task(decode(engine, seqs[2], prompt_kv(runner, prompts[2]), started=started[2]))
        await until(lambda: engine.waiting == 1)
        stats = engine.stats()
        assert stats["kv_budget_tokens"] == budget and stats["kv_used_tokens"] == budget and stats["waiting"] == 1
        assert not started[2].is_set(), "the third request must wait, not fail"
        outputs = [*(await asyncio.gather(*first_two)), await third]
        assert outputs == [tiny_generate(prompts[i], max_tokens) for i in range(3)]
        assert engine.stats()["kv_used_tokens"] == 0 and engine.waiting == 0
        assert engine.stats()["forward_s"] > 0 and engine.stats()["engine_steps"] > 0


async def test_a_request_larger_than_the_budget_is_refused(runner, prompts):
    seq = sequence(runner, "huge", prompts[5], 100)
    with engine_with(runner, kv_budget_tokens=seq.kv_tokens_needed - 1) as engine:
        with pytest.raises(KVBudgetExceeded):
            await engine.open(seq.request_id, [], seq.kv_tokens_needed, seq)


async def test_a_decoding_requests_kv_grows_as_it_decodes(runner, prompts, tiny_generate):
    """Admission allocates the prompt KV and kv_grow_tokens more; each step that would overflow
    grows it by as much again (a quarter of what it holds, when more: not for these short prompts),
    never past prompt plus max_tokens; the budget counts what is allocated."""
    max_tokens = 30
    with engine_with(runner, kv_grow_tokens=4) as engine:
        seqs = [sequence(runner, f"g{i}", prompts[i], max_tokens) for i in (2, 6)]  # 13 and 20 tokens
        seen: list[tuple[int, int, int]] = []  # (length, capacity, kv_used) after each step

        async def run(seq: DecodeSequence) -> list[int]:
            try:
                kv = await engine.open(seq.request_id, prompt_kv(runner, seq.prompt_ids), seq.kv_tokens_needed, seq)
                assert kv.capacity == len(seq.prompt_ids) - 1 + 4
                token, finish_reason = await engine.step(seq, [seq.prompt_ids[-1]])
                while finish_reason is None:
                    seen.append((kv.length, kv.capacity, engine.kv_used_tokens))
                    token, finish_reason = await engine.step(seq, [token])
                assert kv.capacity <= seq.kv_tokens_needed
                return seq.output_ids
            finally:
                engine.release(seq.request_id)

        outputs = await asyncio.gather(*(run(seq) for seq in seqs))
        assert outputs == [tiny_generate(seq.prompt_ids, max_tokens) for seq in seqs]
        assert all(length <= capacity <= length + max(4, length // 4) for length, capacity, _ in seen)
        assert engine.grows >= 2 * len(seqs), "29 fed tokens, 4 to at most 12 more at a time"
        assert engine.stats()["kv_used_tokens"] == 0 and engine.frees == 2


async def test_growth_the_budget_cannot_give_preempts_the_newest_request(runner, prompts, tiny_generate):
    """Two requests fit at admission but not grown to their ends: the newer one is preempted (its
    waiting step fails with KVPreempted, its KV is freed), the older one finishes token-exact, and the
    preempted one, restarted with the tokens it made (what the gateway does), ends as if never stopped."""
    max_tokens = 30
    older, newer = sequence(runner, "older", prompts[2], max_tokens), sequence(runner, "newer", prompts[6], max_tokens)
    budget = (len(prompts[2]) - 1 + 4) + (len(prompts[6]) - 1 + 4) + 10  # two growths of room, then full
    assert budget >= older.kv_tokens_needed and budget >= newer.kv_tokens_needed
    with engine_with(runner, kv_grow_tokens=4, kv_budget_tokens=budget) as engine:
        started = asyncio.Event()
        first = asyncio.create_task(decode(engine, older, prompt_kv(runner, prompts[2]), started=started))
        await started.wait()
        with pytest.raises(KVPreempted, match="newer was preempted"):
            await decode(engine, newer, prompt_kv(runner, prompts[6]))
        made = list(newer.output_ids)
        assert 0 < len(made) < max_tokens and engine.preemptions == 1
        assert await first == tiny_generate(prompts[2], max_tokens)
        assert engine.stats()["kv_used_tokens"] == 0 and engine.running == 0
        again = sequence(runner, "newer-again", [*prompts[6], *made], max_tokens - len(made))
        rest = await decode(engine, again, prompt_kv(runner, again.prompt_ids))
        assert made + rest == tiny_generate(prompts[6], max_tokens)
        assert engine.preemptions == 1


async def test_kv_is_freed_exactly_once_on_abort(runner, prompts):
    with engine_with(runner, kv_budget_tokens=1000) as engine:
        seq = sequence(runner, "aborted", prompts[4], 500)
        task = asyncio.create_task(decode(engine, seq, prompt_kv(runner, prompts[4])))
        await until(lambda: len(seq.output_ids) >= 3)
        assert engine.stats()["kv_used_tokens"] == seq.kv.capacity == len(prompts[4]) - 1 + 256, "grows as it goes"
        task.cancel()  # the gateway's Abort cancels the request's task
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.running == 0)
        engine.release(seq.request_id)  # a second release (abort after finish) changes nothing
        await engine.run(lambda: None)
        assert engine.stats()["kv_used_tokens"] == 0 and engine.frees == 1 and seq.kv.data.numel() == 0
        assert seq.kv._layers is None, "cached per-layer views would keep the freed storage alive"


async def test_abort_while_waiting_for_budget_withdraws_the_request(runner, prompts):
    first = sequence(runner, "holder", prompts[1], 8)
    with engine_with(runner, kv_budget_tokens=first.kv_tokens_needed) as engine:
        await engine.open(first.request_id, [], first.kv_tokens_needed, first)
        waiter = sequence(runner, "waiter", prompts[0], 4)
        task = asyncio.create_task(decode(engine, waiter, prompt_kv(runner, prompts[0])))
        await until(lambda: engine.waiting == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.waiting == 0)
        engine.release(first.request_id)
        await engine.run(lambda: None)
        assert engine.stats()["kv_used_tokens"] == 0 and engine.frees == 1 and engine.running == 0


async def test_prefill_chunks_of_several_requests_share_a_step(runner, prompts):
    """P's use: chunks without sampling, their KV returned; batched equals each prompt alone."""
    chunk_tokens = 16
    with engine_with(runner, max_batch_tokens=64) as engine:
        async def prefill(key: str, prompt_ids: list[int]) -> torch.Tensor:
            kv_ids = prompt_ids[:-1]
            await engine.open(key, [], len(kv_ids))
            try:
                chunks = [await engine.submit(key, kv_ids[s:s + chunk_tokens], sample=False, return_kv=True)
                          for s in range(0, len(kv_ids), chunk_tokens)]
            finally:
                engine.release(key)
            return torch.cat(chunks, dim=3)

        long_prompts = [p for p in prompts if len(p) > 8]
        batched = await asyncio.gather(*(prefill(f"p{i}", p) for i, p in enumerate(long_prompts)))
        assert max(engine.batch_sizes) >= 2
        for prompt_ids, kv in zip(long_prompts, batched):
            alone = prompt_kv(runner, prompt_ids)[0]
            assert kv.shape == alone.shape
            torch.testing.assert_close(kv, alone, rtol=1e-5, atol=1e-5)


def test_one_packed_decode_step_over_ragged_lengths_matches_each_request_alone(runner, prompts):
    alone, packed = [], []
    for prompt_ids in prompts:
        kv_alone, kv_packed = runner.new_kv(len(prompt_ids) + 4), runner.new_kv(len(prompt_ids) + 4)
        for kv in (kv_alone, kv_packed):
            runner.forward(kv, prompt_ids[:-1])  # every test prompt has at least two tokens
        alone.append(kv_alone)
        packed.append(kv_packed)
    feeds = [[p[-1]] for p in prompts]
    for _ in range(3):  # three decode steps: every row one token, all rows in one forward
        expected = torch.stack([runner.forward(kv, feed) for kv, feed in zip(alone, feeds)])
        logits = runner.forward_packed([PackedRow(kv, feed, True) for kv, feed in zip(packed, feeds)])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        tokens = sample_tokens(logits, [SamplingParams()] * len(prompts), [0] * len(prompts))
        assert tokens == expected.argmax(dim=-1).tolist()
        feeds = [[t] for t in tokens]
    for kv_alone, kv_packed in zip(alone, packed):
        assert kv_packed.length == kv_alone.length
        torch.testing.assert_close(kv_packed.slice(0, kv_packed.length), kv_alone.slice(0, kv_alone.length),
                                   rtol=1e-4, atol=1e-4)


def test_batched_sampling_picks_what_each_row_picks_alone():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(),
              SamplingParams(temperature=1.2, top_k=10, seed=9), SamplingParams(temperature=0.7, top_p=0.9, seed=2),
              SamplingParams()]
    indices = [0, 3, 7, 1, 12, 4]
    assert sample_tokens(logits, params, indices) == [sample_token(row, p, i)
                                                      for row, p, i in zip(logits, params, indices)]
    assert sample_tokens(logits[:0], [], []) == []


async def until(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.002)


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three reasons to batch decode steps on a CPU are",
    "Once upon a time there was a serving system split across two datacenters. " * 4,
    "Q: What is 17 times 3?\nA:",
]


@pytest.mark.smollm2
async def test_smollm2_batched_decoding_matches_generate():
    from shared.models import load_tokenizer, resolve_model
    from tests.conftest import reference_generate

    path = resolve_model("smollm2")
    runner = ModelRunner(load_model(path, "float32", "cpu"))
    tokenizer = load_tokenizer(path)
    generate = reference_generate(path)
    prompts = [tokenizer(text)["input_ids"] for text in SMOLLM2_PROMPTS]
    max_tokens = [20, 12, 24, 16, 20, 8]
    with engine_with(runner) as engine:
        seqs = [sequence(runner, f"s{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]

        async def join_later(i: int) -> list[int]:
            await wait_for_steps(engine, 3 * i)
            return await decode(engine, seqs[i], prompt_kv(runner, prompts[i]))

        outputs = await asyncio.gather(*(join_later(i) for i in range(len(seqs))))
        assert outputs == [generate(p, n) for p, n in zip(prompts, max_tokens)]
        assert max(engine.batch_sizes) >= 3


def test_decoder_heartbeat_reports_the_kv_budget_and_its_use(tiny_path):
    from services.decoder.service import DecoderService
    from services.main.role import MainRole
    from shared.config import MainConfig

    config = MainConfig.from_argv(["--model", str(tiny_path), "--kv-budget-tokens", "1234",
                                   "--max-batch-tokens", "64", "--cache-tokens", "0"])
    service = DecoderService(config, MainRole(config.cache))
    try:
        service.advertise_port = 0  # set by start(), which this test does not need
        heartbeat = service._describe()
        assert service.engine.config.max_batch_tokens == 64
        assert heartbeat.waiting == 0
        assert {k: heartbeat.stats[k] for k in ("kv_budget_tokens", "kv_used_tokens", "waiting")} == {
            "kv_budget_tokens": 1234, "kv_used_tokens": 0, "waiting": 0}
    finally:
        service.engine.shutdown()


async def test_a_request_whose_tokens_break_its_grammar_fails_alone(runner, prompts, tiny_path):
    """MD adopting tokens its grammar refuses (the tiers disagree) fails that request with
    grammar_diverged; the request beside it in the same steps finishes, and the engine lives on."""
    from shared.grammar import GrammarDiverged, constraint_for_response_format
    from shared.grammar_masks import GrammarCompiler
    from shared.models import load_tokenizer

    grammars = GrammarCompiler.from_hf(load_tokenizer(tiny_path), runner.config.vocab_size,
                                       (runner.config.eos_token_id,))
    constraint = constraint_for_response_format({"type": "json_object"}).to_dict()
    engine = BatchEngine(runner, EngineConfig(), name="test", grammars=grammars)
    try:
        constrained = DecodeSequence("json", prompts[2], SamplingParams(max_tokens=8, constraint=constraint),
                                     runner.max_context_tokens)
        plain = sequence(runner, "plain", prompts[3], 8)
        not_json = [runner.config.eos_token_id + 7]  # any token that cannot start a JSON object
        broken = decode(engine, constrained, prompt_kv(runner, prompts[2]), eager_ids=not_json)
        results = await asyncio.gather(broken, decode(engine, plain, prompt_kv(runner, prompts[3])),
                                       return_exceptions=True)
        assert isinstance(results[0], GrammarDiverged) and results[0].code == "grammar_diverged"
        assert len(results[1]) == 8
        again = sequence(runner, "after", prompts[4], 4)
        assert len(await decode(engine, again, prompt_kv(runner, prompts[4]))) == 4
    finally:
        engine.shutdown()


async def test_a_step_is_held_for_work_announced_within_reach(runner, prompts):
    """MD's engine holds its next step for RLD's announced cut: the cut's pass joins the step the
    other requests were about to start, instead of waiting one out. A hold lasts at most until the
    work's due time (plus a grace); work due beyond the reach is not held for."""
    with engine_with(runner, hold_steps=1e6) as engine:  # the tiny model's step is a millisecond: reach far
        busy = sequence(runner, "busy", prompts[3], 10_000)
        cut = sequence(runner, "cut", prompts[1], 4)
        await engine.open("cut", prompt_kv(runner, prompts[1]), cut.kv_tokens_needed, cut)
        decoding = asyncio.create_task(decode(engine, busy, prompt_kv(runner, prompts[3])))
        try:
            await wait_for_steps(engine, 5)
            engine.expect("cut", 0.5)
            await asyncio.sleep(0.05)  # the engine picks the announcement up between steps
            held_at = engine.steps
            await asyncio.sleep(0.1)
            assert engine.steps == held_at, "the busy request's steps wait for the announced work"
            _, submitted_ns, started_ns = await engine.submit_timed("cut", [cut.prompt_ids[-1]], sample=True)
            assert (started_ns - submitted_ns) / 1e9 < 0.2, "the held step starts with the announced work"
            assert (engine.holds, engine.holds_met) == (1, 1)
            assert engine.steps > held_at

            engine.expect("cut", 0.05)  # announced, never sent: the hold ends on its own
            await asyncio.sleep(0.3)
            steps = engine.steps
            await asyncio.sleep(0.05)
            assert engine.steps > steps and (engine.holds, engine.holds_met) == (2, 1)
            assert (engine.announced, engine.announced_late) == (2, 1)
        finally:
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)
            engine.release("cut")

    with engine_with(runner, hold_steps=0.5) as engine:  # the reach: half a step, far less than 0.5 s
        busy = sequence(runner, "busy", prompts[3], 10_000)
        cut = sequence(runner, "cut", prompts[1], 4)
        await engine.open("cut", prompt_kv(runner, prompts[1]), cut.kv_tokens_needed, cut)
        decoding = asyncio.create_task(decode(engine, busy, prompt_kv(runner, prompts[3])))
        try:
            await wait_for_steps(engine, 5)
            engine.expect("cut", 0.5)
            await asyncio.sleep(0.05)
            steps = engine.steps
            await asyncio.sleep(0.1)
            assert engine.steps > steps and engine.holds == 0
        finally:
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)
            engine.release("cut")


async def test_a_hold_for_an_announced_cut_is_not_ended_by_feed_only_work_of_the_same_request(runner, prompts):
    """MD queued a Catch-Up pass before RLD announced the cut: the held step waits for the cut's
    pass (which samples), and the queued pass joins it in one row."""
    with engine_with(runner, hold_steps=1e6) as engine:
        busy = sequence(runner, "busy", prompts[3], 10_000)
        cut = sequence(runner, "cut", prompts[1], 4)
        await engine.open("cut", prompt_kv(runner, prompts[1]), cut.kv_tokens_needed, cut)
        decoding = asyncio.create_task(decode(engine, busy, prompt_kv(runner, prompts[3])))
        try:
            await wait_for_steps(engine, 5)
            engine.expect("cut", 0.5)
            await asyncio.sleep(0.05)
            queued = engine.submit("cut", [cut.prompt_ids[-1], 5, 6], sample=False)
            held_at = engine.steps
            await asyncio.sleep(0.1)
            assert engine.steps == held_at and not queued.done(), "still held: the pass only feeds"
            cut.output_ids += [5, 6]
            await engine.submit("cut", [6], sample=True, unfeed=1)
            assert await queued is None
            assert engine.steps == held_at + 1 and (engine.holds, engine.holds_met) == (1, 1)
        finally:
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)
            engine.release("cut")


async def test_an_engine_whose_loop_dies_fails_everything_it_held_and_says_so(runner, prompts, monkeypatch):
    """A bug in the engine thread (here: growing a KV fails) must not leave a caller waiting for ever:
    the work it held, admissions and commands fail at once, new work is refused, and on_death
    tells the service, which then exits (shared/service_runtime.py)."""
    died: list[BaseException] = []
    with engine_with(runner, kv_grow_tokens=1) as engine:
        engine.on_death = died.append
        held = sequence(runner, "held", prompts[2], 8)
        await engine.open("held", prompt_kv(runner, prompts[2]), held.kv_tokens_needed, held)
        await engine.step(held, [prompts[2][-1]])  # fills the one position it was given

        def broken(*args):
            raise RuntimeError("injected: no memory to grow into")

        monkeypatch.setattr(runner, "grown", broken)
        with pytest.raises(NotAdmitted, match="injected"):
            await asyncio.wait_for(engine.step(held, [held.output_ids[-1]]), 10)
        assert len(died) == 1 and "injected" in str(died[0])
        with pytest.raises(NotAdmitted):
            await asyncio.wait_for(engine.run(lambda: None), 10)
        waiting = sequence(runner, "late", prompts[1], 4)
        with pytest.raises(NotAdmitted):
            await asyncio.wait_for(engine.open("late", prompt_kv(runner, prompts[1]), waiting.kv_tokens_needed,
                                               waiting), 10)
        assert engine.kv_used_tokens == 0, "what it held is freed"


async def test_commands_queued_when_the_engine_stops_fail_rather_than_hang(runner):
    engine = BatchEngine(runner, EngineConfig(), name="test")
    started, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def blocks() -> None:  # holds the engine thread while more commands queue behind it
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)

    first = asyncio.ensure_future(engine.run(blocks))
    await started.wait()
    queued = asyncio.ensure_future(engine.run(lambda: "never"))
    await asyncio.sleep(0.05)
    stopping = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
    await asyncio.sleep(0.05)
    release.set()
    await stopping
    await first
    with pytest.raises(NotAdmitted):
        await asyncio.wait_for(queued, 10)


async def test_the_timeline_records_each_step_copy_hold_and_mark_in_wall_clock_order(runner, prompts, tmp_path):
    """`--engine-timeline`: every step with its rows, the KV copies and admissions between steps,
    a hold for announced work and a service's marks, with times that line up with time.time_ns."""
    path = tmp_path / "engine.jsonl"
    before_ns = time.time_ns()
    with engine_with(runner, timeline_path=str(path), hold_steps=1e6) as engine:
        seq = sequence(runner, "r", prompts[2], 6)
        parts = prompt_kv(runner, prompts[2])
        await engine.open("r", (), seq.kv_tokens_needed, seq, pending_tokens=parts[0].shape[3])
        await engine.fill("r", parts[0])
        busy = asyncio.create_task(decode(engine, sequence(runner, "busy", prompts[3], 10_000),
                                          prompt_kv(runner, prompts[3])))
        try:
            await wait_for_steps(engine, 3)
            engine.expect("r", 0.05)
            await asyncio.sleep(0.03)
            engine.mark("r", "cut_received", eager_tokens=0)
            token, finish_reason = await engine.step(seq, [seq.prompt_ids[-1]])
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
        await decode_on(engine, seq, token, finish_reason)
        engine.release("r")
    events = read_timeline(path)
    after_ns = time.time_ns()
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == engine.steps
    assert all(before_ns <= e["t_ns"] <= e.get("end_ns", e["t_ns"]) <= after_ns for e in events)
    assert [e["t_ns"] for e in steps] == sorted(e["t_ns"] for e in steps)
    assert all(0 < e["cpu_ns"] <= e["end_ns"] - e["t_ns"] + 1_000_000 for e in steps), "the thread's CPU time in it"
    r_rows = [row for s in steps for row in s["rows"] if row[0] == "r"]
    assert len(r_rows) == 6 and all(row[1] == 1 and row[2] for row in r_rows)
    labels = [e["label"] for e in events if e["kind"] == "command"]
    assert labels[:2] == ["open", "fill"] and "expect" in labels and labels[-1] == "release"
    assert any(e["kind"] == "admitted" and e["key"] == "r" for e in events)
    holds = [e for e in events if e["kind"] == "hold"]
    assert len(holds) == 1 and holds[0]["keys"] == ["r"] and holds[0]["met"]
    mark = next(e for e in events if e["kind"] == "mark")
    assert (mark["key"], mark["what"], mark["eager_tokens"]) == ("r", "cut_received", 0)
    held_step = next(s for s in steps if any(row[0] == "r" for row in s["rows"]))
    assert holds[0]["t_ns"] < holds[0]["end_ns"] <= held_step["t_ns"], "the hold comes before the step it held"
    assert len(held_step["rows"]) == 2, "the cut's work joined the busy request's step"
    assert next(row for row in held_step["rows"] if row[0] == "r")[3] >= mark["t_ns"]


async def test_an_engine_without_a_timeline_writes_none(runner, prompts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with engine_with(runner) as engine:
        seq = sequence(runner, "r", prompts[1], 3)
        assert await decode(engine, seq, prompt_kv(runner, prompts[1]))
        engine.mark("r", "ignored")
    assert engine.timeline is None and not list(tmp_path.iterdir())


def step_rows(path) -> list[list[tuple[str, int]]]:
    """Each step's rows from a timeline: (request, tokens fed)."""
    return [[(row[0], row[1]) for row in e["rows"]] for e in read_timeline(path) if e["kind"] == "step"]


@pytest.mark.parametrize("by_admission", [False, True])
async def test_long_work_goes_in_admission_order_on_p_and_background_work_last(runner, prompts, tmp_path,
                                                                              by_admission):
    """P's engine takes prompts' chunks in the order the prompts were admitted (a later prompt's
    chunk queued first waits), a background prompt's (a warm-up) after everyone's; a decoder's
    engine keeps queue order. The KV each returns equals the prompt computed alone."""
    path = tmp_path / "engine.jsonl"
    ids = {"warm": prompts[5][:17], "old": prompts[3][:17], "new": prompts[6][:17]}
    with engine_with(runner, max_batch_tokens=16, long_work_by_admission=by_admission,
                     timeline_path=str(path)) as engine:
        for key in ids:
            await engine.open(key, [], 16, background=key == "warm")
        with engine_paused(engine):
            await asyncio.sleep(0.05)
            futures = {key: engine.submit(key, ids[key][:16], sample=False, return_kv=True)
                       for key in ("new", "warm", "old")}
        kvs = {key: await future for key, future in futures.items()}
        for key in ids:
            engine.release(key)
    expected = ["old", "new", "warm"] if by_admission else ["new", "old", "warm"]
    assert step_rows(path) == [[(key, 16)] for key in expected]
    for key, kv in kvs.items():
        torch.testing.assert_close(kv, prompt_kv(runner, ids[key])[0], rtol=1e-5, atol=1e-5)


async def test_attention_cost_lets_a_long_context_row_take_only_what_its_attention_leaves_room_for(runner, prompts,
                                                                                                   tmp_path):
    """With `attention_cost_tokens` C, the oldest prompt's chunk goes whole and a later prompt over
    a long cached context gets the budget that chunk leaves, each of its tokens counted 1 + n / C:
    here 32 tokens over 0 positions cost 32 * (1 + 16/32) = 48 of 64, leaving 16, in which a row
    over 96 positions fits 3 tokens (3 * (1 + 97.5/32) = 12.1; 4 would cost 16.4). Without C it
    would take all 32. Split across steps, its KV equals the prompt computed alone."""
    rng = random.Random(11)
    vocab = runner.config.vocab_size
    cold, warm = ([rng.randrange(vocab) for _ in range(n)] for n in (33, 129))
    path = tmp_path / "engine.jsonl"
    with engine_with(runner, max_batch_tokens=64, attention_cost_tokens=32, long_work_by_admission=True,
                     timeline_path=str(path)) as engine:
        await engine.open("cold", [], 32)
        await engine.open("warm", [prompt_kv(runner, warm[:97])[0]], 128)
        with engine_paused(engine):
            await asyncio.sleep(0.05)
            warm_future = engine.submit("warm", warm[96:128], sample=False, return_kv=True)
            cold_future = engine.submit("cold", cold[:32], sample=False, return_kv=True)
        cold_kv, warm_kv = await cold_future, await warm_future
        engine.release("cold")
        engine.release("warm")
    rows = step_rows(path)
    assert rows[0] == [("cold", 32), ("warm", 3)]
    assert rows[1] == [("warm", 29)], "alone, the oldest row goes whole"
    torch.testing.assert_close(cold_kv, prompt_kv(runner, cold)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(warm_kv, prompt_kv(runner, warm)[0][:, :, :, 96:], rtol=1e-5, atol=1e-5)
