"""A prompt's logprobs (completions `echo` with `logprobs`, the loglikelihood requests evaluation
harnesses send): P scores every prompt token but the first from the logits of its chunks, equal to
transformers' own forward over the prompt; served by P alone for `max_tokens: 0`, before the answer
otherwise."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from services.gateway.run.attempt import Attempt, GenerationRequest
from services.gateway.run.request_run import RequestRun, RunPhase
from services.prefill.prefiller import Prefiller, chunk_ranges
from shared import messages
from shared.batch_engine import BatchEngine
from shared.config import CommonConfig, EngineConfig, GatewayConfig
from shared.messages import PrefillDone, PromptLogprobs, TokenChunk
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import load_model
from shared.names import Pipeline, Role
from shared.sampling import SamplingParams, TokenLogprob

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, "float32", "cpu")


def reference(model, prompt_ids: list[int], top_n: int) -> list[tuple[float, list[int]]]:
    """transformers' forward over the whole prompt: each token's logprob given the tokens before it
    (from the second on), and the top_n likeliest token ids there."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [(logprobs[i - 1, prompt_ids[i]].item(), logprobs[i - 1].topk(top_n).indices.tolist())
            for i in range(1, len(prompt_ids))]


def assert_matches(scored: list[TokenLogprob], expected: list[tuple[float, list[int]]]) -> None:
    assert len(scored) == len(expected)
    for i, (entry, (logprob, top_ids)) in enumerate(zip(scored, expected)):
        assert entry.logprob == pytest.approx(logprob, abs=TOLERANCE), f"prompt token {i + 1}"
        assert [token for token, _ in entry.top] == top_ids, f"prompt token {i + 1}"


async def prefill_scored(prefiller: Prefiller, key: str, prompt_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """P's loop for one prompt: every chunk of positions [0, n-1) through the engine, scored."""
    kv_tokens = len(prompt_ids) - 1
    await prefiller.open(key, kv_tokens)
    try:
        scored: list[TokenLogprob] = []
        for chunk in chunk_ranges(kv_tokens, prefiller.chunk_tokens):
            _, logprobs, _, _ = await prefiller.compute_scored_chunk(key, prompt_ids, chunk, top_n)
            scored += logprobs
        return scored
    finally:
        prefiller.release(key)


async def test_chunked_prompt_logprobs_equal_transformers_forward_beside_other_work(model):
    """Chunks split across steps (the batch budget is smaller than a chunk) and sharing them with a
    decode that samples and a prefill that is not scored: each row's logits go to their own work."""
    rng = random.Random(3)
    vocab = model.config.vocab_size
    prompt_ids = [rng.randrange(vocab) for _ in range(150)]
    other_ids = [rng.randrange(vocab) for _ in range(90)]
    engine = BatchEngine(ModelRunner(model), EngineConfig(max_batch_tokens=48), name="test")
    try:
        prefiller = Prefiller(engine, chunk_tokens=64)
        seq = DecodeSequence("decode", other_ids[:5], SamplingParams(max_tokens=30, ignore_eos=True),
                             engine.runner.max_context_tokens)

        async def decode() -> None:
            await engine.open("decode", [], seq.kv_tokens_needed, seq)
            try:
                await engine.step(seq, seq.prompt_ids)
                while len(seq.output_ids) < 30:
                    await engine.step(seq, seq.output_ids[-1:])
            finally:
                engine.release("decode")

        async def unscored() -> None:
            await prefiller.open("plain", len(other_ids) - 1)
            try:
                for chunk in chunk_ranges(len(other_ids) - 1, 64):
                    await prefiller.compute_chunk("plain", other_ids, chunk)
            finally:
                prefiller.release("plain")

        scored, *_ = await asyncio.gather(prefill_scored(prefiller, "scored", prompt_ids, 3), decode(), unscored())
    finally:
        engine.shutdown()
    assert_matches(scored, reference(model, prompt_ids, 3))


# --- the gateway's run: P alone, and the answer held until the prompt's logprobs are in -------------

GATEWAY = GatewayConfig(
    common=CommonConfig("nats://127.0.0.1:4222", "gateway-test", "INFO", "", 1.0), model="tiny",
    host="127.0.0.1", port=0, default_pipeline="auto", request_timeout_s=10.0, token_timeout_s=5.0,
    max_body_bytes=64 * 1024, default_max_tokens=32)
PROMPT = [11, 12, 13, 14]


def entry(i: int) -> TokenLogprob:
    return TokenLogprob(-float(i), ((i, -0.5),))


class Dispatch:
    """The dispatcher's two calls, recorded: P alone for max_tokens 0, else P-MD."""

    def __init__(self) -> None:
        self.started: list[GenerationRequest] = []
        self.stopped: list[str] = []

    async def start(self, req, output_offset, avoid, on_event) -> Attempt:
        self.started.append(req)
        instances = {Role.PREFILL: "p-0"} if req.prefill_only else {Role.PREFILL: "p-0", Role.MAIN: "md-0"}
        return Attempt(req, output_offset, Pipeline.P if req.prefill_only else Pipeline.P_MD, None, instances)

    async def stop(self, attempt: Attempt, reason: str) -> None:
        self.stopped.append(reason)


async def run_of(max_tokens: int) -> tuple[RequestRun, Dispatch]:
    dispatch = Dispatch()
    req = GenerationRequest("req-echo", list(PROMPT), SamplingParams(max_tokens=max_tokens), None, None, 0.0,
                            prompt_logprobs=1)
    run = RequestRun(SimpleNamespace(), req, GATEWAY, dispatch.start, dispatch.stop, is_alive=lambda _: True)
    await run.start()
    return run, dispatch


async def send(run: RequestRun, *events: object) -> None:
    for event in events:
        await run._on_event(SimpleNamespace(data=messages.encode(event)))


async def test_a_prompt_only_request_is_served_by_p_alone_and_ends_with_its_report():
    run, dispatch = await run_of(max_tokens=0)
    assert run.pipeline == Pipeline.P and run.instances == {"prefill": "p-0"}
    await send(run, PromptLogprobs("req-echo", 1, [entry(1), entry(2)]), PromptLogprobs("req-echo", 3, [entry(3)]),
               PrefillDone("req-echo", "p-0", 3, 0.01, {}, {}))
    assert [t async for t in run.tokens()] == []  # no decoder, no token
    assert run.phase is RunPhase.FINISHED and run.finish_reason == "length"
    assert run.prompt_logprobs == [None, entry(1), entry(2), entry(3)]
    await run.close("finished")
    assert dispatch.stopped == ["finished"]  # the one Abort, as for any request


async def test_the_answer_waits_for_the_prompts_last_logprobs():
    """A decoder's tokens (here the whole answer) may arrive before P's last chunk of logprobs: the
    run holds them, and finishes only once the prompt is scored."""
    run, _ = await run_of(max_tokens=2)
    await send(run, PromptLogprobs("req-echo", 1, [entry(1)]),
               TokenChunk("req-echo", 0, [7, 8], Role.MAIN, "length"))
    stream = run.tokens()
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not waiting.done() and run.prompt_logprobs is None and run.phase is RunPhase.RUNNING
    await send(run, PromptLogprobs("req-echo", 2, [entry(2), entry(3)]))
    first = await waiting
    assert [first.token_id] + [t.token_id async for t in stream] == [7, 8]
    assert run.prompt_logprobs == [None, entry(1), entry(2), entry(3)] and run.phase is RunPhase.FINISHED
