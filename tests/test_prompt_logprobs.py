"""A prompt's logprobs (completions `echo` with `logprobs`, the loglikelihood requests evaluation
harnesses send): P scores every prompt token but the first from the logits of its chunks, equal to
transformers' own forward over the prompt; served by P alone for `max_tokens: 0`, before the answer
otherwise."""
from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from types import SimpleNamespace

import openai
import pytest
import torch

from services.gateway.run.attempt import Attempt, GenerationRequest
from services.gateway.run.request_run import RequestRun, RunPhase
from services.prefill.prefiller import Prefiller
from shared.batch_engine import BatchEngine
from shared.config import CommonConfig, EngineConfig, GatewayConfig
from shared.messages import PrefillDone, PromptLogprobs, TokenChunk
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import load_model
from shared.names import Pipeline, Role
from shared.sampling_params import SamplingParams, TokenLogprob

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
        async with aclosing(prefiller.chunks(key, prompt_ids, 0, top_n)) as chunks:
            async for chunk in chunks:
                scored += chunk.logprobs
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
                async with aclosing(prefiller.chunks("plain", other_ids, 0)) as chunks:
                    assert all([chunk.logprobs is None async for chunk in chunks])
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
ECHO_ID = "req-" + "e" * 32  # the KV wire carries request ids as UUIDs


def entry(i: int) -> TokenLogprob:
    return TokenLogprob(-float(i), ((i, -0.5),))


class Dispatch:
    """The run's host: its two calls recorded (P alone for max_tokens 0, else P-MD), the rest quiet."""

    def __init__(self) -> None:
        self.started: list[GenerationRequest] = []
        self.stopped: list[str] = []

    async def dispatch(self, run, req, output_offset, avoid) -> Attempt:
        self.started.append(req)
        instances = {Role.PREFILL: "p-0"} if req.prefill_only else {Role.PREFILL: "p-0", Role.MAIN: "md-0"}
        return Attempt(req, output_offset, Pipeline.P if req.prefill_only else Pipeline.P_MD, None, instances)

    async def stop(self, attempt: Attempt, reason: str) -> None:
        self.stopped.append(reason)

    def is_alive(self, instance_id: str) -> bool:
        return True

    def instance_gone(self, instance_id: str) -> None:
        pass

    async def publish(self, subject: str, message: object) -> None:
        pass

    async def answer_grew(self, attempt: Attempt, token_ids: list[int]) -> None:
        pass

    def count_loss(self, tier: Role, how: str) -> None:
        pass

    def count_recovery(self, action: str) -> None:
        pass


async def run_of(max_tokens: int) -> tuple[RequestRun, Dispatch]:
    dispatch = Dispatch()
    req = GenerationRequest(ECHO_ID, list(PROMPT), SamplingParams(max_tokens=max_tokens), None, None, 0.0,
                            prompt_logprobs=1)
    run = RequestRun(req, GATEWAY, dispatch)
    await run.start()
    return run, dispatch


async def send(run: RequestRun, *events: object) -> None:
    for event in events:
        run.deliver(event)


async def test_a_prompt_only_request_is_served_by_p_alone_and_ends_with_its_report():
    run, dispatch = await run_of(max_tokens=0)
    assert run.pipeline == Pipeline.P and run.instances == {"prefill": "p-0"}
    await send(run, PromptLogprobs(ECHO_ID, 1, [entry(1), entry(2)]), PromptLogprobs(ECHO_ID, 3, [entry(3)]),
               PrefillDone(ECHO_ID, "p-0", 3, 0.01, {}, {}))
    assert [t async for t in run.tokens()] == []  # no decoder, no token
    assert run.phase is RunPhase.FINISHED and run.finish_reason == "length"
    assert run.prompt_logprobs == [None, entry(1), entry(2), entry(3)]
    await run.close("finished")
    assert dispatch.stopped == ["finished"]  # the one Abort, as for any request


async def test_the_answer_waits_for_the_prompts_last_logprobs():
    """A decoder's tokens (here the whole answer) may arrive before P's last chunk of logprobs: the
    run holds them, and finishes only once the prompt is scored."""
    run, _ = await run_of(max_tokens=2)
    await send(run, PromptLogprobs(ECHO_ID, 1, [entry(1)]),
               TokenChunk(ECHO_ID, 0, [7, 8], Role.MAIN, "length"))
    stream = run.tokens()
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not waiting.done() and run.prompt_logprobs is None and run.phase is RunPhase.RUNNING
    await send(run, PromptLogprobs(ECHO_ID, 2, [entry(2), entry(3)]))
    first = await waiting
    assert [first.token_id] + [t.token_id async for t in stream] == [7, 8]
    assert run.prompt_logprobs == [None, entry(1), entry(2), entry(3)] and run.phase is RunPhase.FINISHED


# --- on a real stack, with the openai client ----------------------------------------------------------

LONG_TEXT = "Evaluation harnesses score a continuation by the sum of its tokens' logprobs. " * 10


SHARE_STACK = True  # its tests only send requests


@pytest.fixture
async def client(stack):
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


def check_prompt_logprobs(logprobs, prompt_ids: list[int], tokenizer, model, top_n: int) -> None:
    """OpenAI's shape (the first token's entries null) with transformers' numbers."""
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference(model, prompt_ids, top_n)
    for i, (logprob, top_ids) in enumerate(expected, start=1):
        assert logprobs.token_logprobs[i] == pytest.approx(logprob, abs=TOLERANCE), f"prompt token {i}"
        top = logprobs.top_logprobs[i]
        shown = {tokenizer.decode([t], skip_special_tokens=False) for t in top_ids} | {logprobs.tokens[i]}
        assert set(top) == shown and top[logprobs.tokens[i]] == pytest.approx(logprob, abs=TOLERANCE)
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


async def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_from_p_alone(client, tiny_tokenizer, model):
    text = "[p alone] " + LONG_TEXT  # more than two of P's 64-token chunks
    prompt_ids = tiny_tokenizer(text)["input_ids"]
    assert len(prompt_ids) > 2 * 64
    result = await client.completions.create(model="tiny-llama", prompt=text, echo=True, max_tokens=0, logprobs=2)
    choice = result.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    check_prompt_logprobs(choice.logprobs, prompt_ids, tiny_tokenizer, model, 2)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 0)
    pdd = result.model_extra["pdd"]
    assert pdd["pipeline"] == "p" and set(pdd["instances"]) == {"prefill"}  # no decoder took part
    assert pdd["prefill"]["computed_tokens"] == len(prompt_ids) - 1

    streamed = [chunk async for chunk in await client.completions.create(
        model="tiny-llama", prompt=prompt_ids, echo=True, max_tokens=0, logprobs=2, stream=True)]
    assert len(streamed) == 1 and streamed[0].choices[0].text == tiny_tokenizer.decode(prompt_ids)
    assert streamed[0].choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs


async def test_a_prompt_whose_prefix_p_has_cached_is_scored_whole(client, tiny_tokenizer, model):
    """P's cache holds the context (an answer to it was served), as it does when a harness scores many
    continuations of one context: the logits of the cached positions are needed, so P computes them."""
    context = "[cached] " + LONG_TEXT
    warm = await client.completions.create(model="tiny-llama", prompt=context, max_tokens=2, temperature=0)
    again = await client.completions.create(model="tiny-llama", prompt=context, max_tokens=2, temperature=0)
    assert again.model_extra["pdd"]["cached_tokens"]["prefill"] > 64, "P's cache should hold the context"
    assert warm.choices[0].text == again.choices[0].text
    for text in (context, context + " And the continuation."):
        prompt_ids = tiny_tokenizer(text)["input_ids"]
        result = await client.completions.create(model="tiny-llama", prompt=text, echo=True, max_tokens=0,
                                                 logprobs=1)
        check_prompt_logprobs(result.choices[0].logprobs, prompt_ids, tiny_tokenizer, model, 1)
        pdd = result.model_extra["pdd"]
        assert pdd["cached_tokens"]["prefill"] == 0 and pdd["prefill"]["computed_tokens"] == len(prompt_ids) - 1


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_echo_with_an_answer_puts_the_prompt_and_its_logprobs_first(client, tiny_tokenizer, model, pipeline):
    """lm-evaluation-harness scores with max_tokens 1 and echo: the prompt's part, then the answer's
    own, as it comes without echo; streamed, the first chunk starts with the prompt."""
    text = f"[echo {pipeline}] " + LONG_TEXT
    prompt_ids = tiny_tokenizer(text)["input_ids"]
    n = len(prompt_ids)
    args = {"model": "tiny-llama", "prompt": text, "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "extra_body": {"pdd": {"pipeline": pipeline}}}
    plain = (await client.completions.create(**args)).choices[0]
    echoed = (await client.completions.create(**args, echo=True)).choices[0]
    assert echoed.text == text + plain.text and echoed.finish_reason == plain.finish_reason == "length"
    logprobs = echoed.logprobs
    assert logprobs.tokens[n:] == plain.logprobs.tokens and len(logprobs.tokens) == n + 3
    assert logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=TOLERANCE)
    prompt_part = SimpleNamespace(**{key: value[:n] for key, value in logprobs.model_dump().items()})
    check_prompt_logprobs(prompt_part, prompt_ids, tiny_tokenizer, model, 1)
    offsets = logprobs.text_offset
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))

    chunks = [chunk.choices[0] async for chunk in await client.completions.create(**args, echo=True, stream=True)]
    chunks = [c for c in chunks if c.logprobs is not None]
    assert chunks[0].text.startswith(text) and "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks for t in c.logprobs.tokens] == logprobs.tokens
    streamed = [lp for c in chunks for lp in c.logprobs.token_logprobs]  # another run: batches may round apart
    assert streamed[0] is None is logprobs.token_logprobs[0]
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=TOLERANCE)
    assert [o for c in chunks for o in c.logprobs.text_offset] == offsets


async def test_echo_without_logprobs_and_no_tokens_is_the_prompt(client):
    result = await client.completions.create(model="tiny-llama", prompt="Just this.", echo=True, max_tokens=0)
    assert result.choices[0].text == "Just this." and result.choices[0].logprobs is None
    assert result.usage.completion_tokens == 0


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("completions", {"prompt": "x", "echo": "yes"}, "echo"),
])
async def test_a_bad_echo_or_max_tokens_is_refused_naming_it(stack, session, route, body, param):
    async with session.post(f"{stack.api_url}/v1/{route}", json={"model": "tiny-llama", **body}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["param"] == param
