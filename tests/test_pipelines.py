"""End to end on real processes (nats-server, P, RLD, MD, gateway) with the tiny model:
every pipeline and every handoff point is token-exact against transformers' `generate`."""
from __future__ import annotations

import openai
import pytest

from tools.api_client import ApiError, sse_events, stream_completion

from helpers import complete

PROMPT_TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "In a distant galaxy, a small robot learned to paint sunsets " * 3,
    "List three reasons why tests should run real processes: " * 6,
    "Once upon a time there was a serving system split across two datacenters. " * 12,
]
SHARE_STACK = True  # no test kills, restarts or reconfigures a role


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


def fresh(tiny_tokenizer, tag: str, prompt_ids: list[int]) -> list[int]:
    """The prompt behind a tag no other test used, so neither P's cache nor MD's DRC holds it."""
    return tiny_tokenizer(f"[{tag}] ")["input_ids"] + prompt_ids


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_every_pipeline_matches_generate(stack, session, prompts, tiny_tokenizer, tiny_generate, pipeline):
    # MD's KV path is held back as a WAN would, so RLD makes the first tokens
    delay = {"md_kv_delay_ms": 40} if pipeline == "p-rld-md" else {}
    for prompt_ids in prompts:
        prompt_ids = fresh(tiny_tokenizer, pipeline, prompt_ids)
        result = await complete(session, stack, prompt_ids, 24, pipeline=pipeline, **delay)
        assert result.token_ids == tiny_generate(prompt_ids, 24), f"prompt of {len(prompt_ids)} tokens"
        assert result.summary["pipeline"] == pipeline
        if "main" in result.tiers:  # RLD may finish a short answer before MD's KV is in: then MD drops it
            main_kv = result.summary["kv"]["main"]
            assert main_kv["cached_tokens"] + main_kv["kv_tokens"] == len(prompt_ids) - 1
        if pipeline == "p-md":
            assert set(result.tiers) == {"main"}
            # P reports once its KV is sent, long before MD's 24th token
            prefill = result.summary["prefill"]
            assert prefill["computed_tokens"] == len(prompt_ids) - 1 - result.summary["cached_tokens"]["prefill"]
            assert prefill["prefill_s"] > 0
        else:
            assert result.tiers[0] == "relay", "RLD has the KV first and must make the first token"
            relay_kv = result.summary["kv"]["relay"]  # RLD's cache may hold a prefix (the prompts share one)
            assert relay_kv["cached_tokens"] + relay_kv["kv_tokens"] == len(prompt_ids) - 1


@pytest.mark.parametrize("eager", [0, 1, 10, 50])
async def test_handoff_after_any_number_of_eager_tokens_is_token_exact(stack, session, prompts, tiny_tokenizer,
                                                                       tiny_generate, eager):
    prompt_ids = fresh(tiny_tokenizer, f"handoff {eager}", prompts[3])
    result = await complete(session, stack, prompt_ids, 64, pipeline="p-rld-md", handoff_at=eager)
    assert result.token_ids == tiny_generate(prompt_ids, 64)
    assert result.tiers == ["relay"] * eager + ["main"] * (64 - eager)
    assert result.handoff["eager_tokens"] == eager
    assert result.summary["tokens_by_tier"] == {"relay": eager, "main": 64 - eager}


async def test_relay_that_finishes_first_ends_the_request(stack, session, prompts, tiny_generate):
    result = await complete(session, stack, prompts[2], 6, pipeline="p-rld-md", handoff_at=10)
    assert result.token_ids == tiny_generate(prompts[2], 6)
    assert set(result.tiers) == {"relay"} and result.finish_reason == "length"


async def test_seeded_sampling_gives_the_same_tokens_on_every_tier(stack, session, prompts):
    def body(pipeline: str, seed: int) -> dict:
        return {"prompt": prompts[1], "max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "top_k": 50,
                "seed": seed, "pdd": {"pipeline": pipeline, "handoff_at": 7} if pipeline == "p-rld-md" else
                {"pipeline": pipeline}}

    md_only = await stream_completion(session, stack.api_url, body("p-md", 1234))
    split = await stream_completion(session, stack.api_url, body("p-rld-md", 1234))
    assert split.tiers[:7] == ["relay"] * 7 and split.tiers[7:] == ["main"] * 33
    assert md_only.token_ids == split.token_ids
    other_seed = await stream_completion(session, stack.api_url, body("p-md", 99))
    assert other_seed.token_ids != md_only.token_ids


async def test_stop_token_ids_and_min_tokens_give_the_same_answer_on_every_tier(stack, session, prompts,
                                                                                 tiny_tokenizer, tiny_generate):
    """The client's stop token ends the answer where it first comes, shown, whichever tier makes it;
    with min_tokens past that place it is kept out of the early positions, on RLD and MD alike."""
    prompt_ids = fresh(tiny_tokenizer, "stop ids", prompts[3])
    greedy = tiny_generate(prompt_ids, 40)
    stop_id = greedy[12]
    first = greedy.index(stop_id)

    def body(pipeline: str, **extra) -> dict:
        handoff = {"handoff_at": 5} if pipeline == "p-rld-md" else {}
        return {"prompt": prompt_ids, "max_tokens": 40, "temperature": 0, "stop_token_ids": [stop_id],
                "pdd": {"pipeline": pipeline, **handoff}, **extra}

    for pipeline in ("p-md", "p-rld-md"):
        result = await stream_completion(session, stack.api_url, body(pipeline))
        assert result.token_ids == greedy[:first + 1] and result.finish_reason == "stop", pipeline
        assert result.text == tiny_tokenizer.decode(greedy[:first + 1], skip_special_tokens=True)
    held = [await stream_completion(session, stack.api_url, body(pipeline, min_tokens=first + 3))
            for pipeline in ("p-md", "p-rld-md")]
    assert held[0].token_ids == held[1].token_ids
    assert stop_id not in held[0].token_ids[:first + 3] and len(held[0].token_ids) >= first + 3
    assert held[1].tiers[:5] == ["relay"] * 5 and "main" in held[1].tiers


async def stream_logprobs(session, stack, body: dict) -> tuple[list[int], list[str], list[float], list[dict]]:
    """A streamed completion's token ids, tiers, and each token's logprob and likeliest alternatives."""
    ids, tiers, logprobs, tops = [], [], [], []
    async with session.post(stack.api_url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            assert "error" not in event, event
            for token in event["pdd"]["tokens"]:
                ids.append(token["id"])
                tiers.append(token["tier"])
            if event["choices"] and event["choices"][0]["logprobs"]:
                logprobs += event["choices"][0]["logprobs"]["token_logprobs"]
                tops += event["choices"][0]["logprobs"]["top_logprobs"]
    assert len(logprobs) == len(ids)
    return ids, tiers, logprobs, tops


@pytest.mark.parametrize("temperature", [0, 0.8])
async def test_penalties_bias_and_logprobs_are_the_same_on_every_tier(stack, session, prompts, tiny_tokenizer,
                                                                      tiny_generate, temperature):
    """Every option that reads earlier tokens gives the same answer when MD takes over after RLD made
    3 of them, and the logprobs MD reports for its tokens match what P-MD reports for the same ones."""
    prompt_ids = fresh(tiny_tokenizer, f"options {temperature}", prompts[3])
    plain = tiny_generate(prompt_ids, 24)
    banned = plain[0]

    def body(pipeline: str) -> dict:
        handoff = {"handoff_at": 3} if pipeline == "p-rld-md" else {}
        return {"prompt": prompt_ids, "max_tokens": 24, "temperature": temperature, "seed": 77,
                "presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
                "logit_bias": {str(banned): -100}, "min_p": 0.02, "logprobs": 3, "ignore_eos": True,
                "pdd": {"pipeline": pipeline, **handoff}}

    md_ids, md_tiers, md_logprobs, md_tops = await stream_logprobs(session, stack, body("p-md"))
    split_ids, split_tiers, split_logprobs, split_tops = await stream_logprobs(session, stack, body("p-rld-md"))
    assert split_tiers == ["relay"] * 3 + ["main"] * 21 and set(md_tiers) == {"main"}
    assert split_ids == md_ids and len(md_ids) == 24
    assert banned not in md_ids and md_ids != plain  # the options did something
    assert split_logprobs == pytest.approx(md_logprobs, abs=1e-4)
    for md_top, split_top in zip(md_tops, split_tops):
        assert split_top.keys() == md_top.keys()
        assert list(split_top.values()) == pytest.approx(list(md_top.values()), abs=1e-4)


async def test_openai_client_gets_chat_logprobs_on_both_pipelines(stack, tiny_tokenizer, tiny_generate):
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count to five."}]
    expected = None
    for pdd in ({"pipeline": "p-md"}, {"pipeline": "p-rld-md", "handoff_at": 4}):
        result = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                                      temperature=0, logprobs=True, top_logprobs=2,
                                                      extra_body={"pdd": pdd, "ignore_eos": True})
        content = result.choices[0].logprobs.content
        assert len(content) == result.usage.completion_tokens == 12
        assert "".join(c.token for c in content) == result.choices[0].message.content
        for entry in content:  # greedy without options: the chosen token is the likeliest
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob <= 0
            assert entry.top_logprobs[1].logprob <= entry.logprob
        got = [(c.token, c.logprob) for c in content]
        if expected is None:
            expected = got
        else:
            assert [t for t, _ in got] == [t for t, _ in expected]
            assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-4)
    await client.close()


async def test_openai_client_works_streamed_and_not(stack, tiny_tokenizer, tiny_generate):
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if not isinstance(prompt_ids, list) else prompt_ids)
    expected = tiny_tokenizer.decode(tiny_generate(prompt_ids, 12), skip_special_tokens=True)

    full = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.content == expected
    assert full.usage.prompt_tokens == len(prompt_ids) and full.usage.completion_tokens == 12

    stream = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                                  temperature=0, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == expected
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    await client.close()


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (b'{"model": "gpt-9", "prompt": "hi"}', 404),
    (b'{"prompt": "hi", "temperature": -3}', 400),
    (b'{"prompt": "hi", "max_tokens": "lots"}', 400),
    (b'{"prompt": [1, 2, 3], "pdd": {"pipeline": "p-rld"}}', 400),
    (b'{"prompt": "' + b"word " * 5000 + b'"}', 400),
])
async def test_bad_input_gets_an_openai_error_and_the_gateway_keeps_serving(stack, session, prompts, body, status):
    async with session.post(stack.api_url + "/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
    result = await complete(session, stack, prompts[0], 3)
    assert len(result.token_ids) == 3


async def test_unknown_pipeline_is_refused_before_any_work(stack, session, prompts):
    with pytest.raises(ApiError) as err:
        await complete(session, stack, prompts[0], 3, pipeline="p-rld")
    assert err.value.status == 400


async def test_a_sessions_next_turn_finds_the_answer_in_ps_cache(stack, session, tiny_tokenizer, tiny_generate):
    # every 32 tokens of an answer the gateway has P compute the answer so far into its prefix
    # cache; the next turn (prompt, answer, a tool's output) then hits it on P as on MD
    import asyncio

    from helpers import fresh_heartbeats, random_prompt

    prompt = fresh(tiny_tokenizer, "session", random_prompt(7, 150))
    first = await complete(session, stack, prompt, 80, pipeline="p-md")
    async with asyncio.timeout(30):  # until P ran the warm-ups (they are not requests anyone waits for)
        while (await fresh_heartbeats(stack.nats_url, ("prefill",)))["prefill"].running:
            await asyncio.sleep(0.1)
    turn = prompt + first.token_ids + random_prompt(8, 20)
    second = await complete(session, stack, turn, 8, pipeline="p-md")
    assert second.summary["cached_tokens"]["prefill"] >= len(prompt) + 64 - 1, "the answer's first 64 tokens"
    assert second.token_ids == tiny_generate(turn, 8)


async def test_n_choices_compute_the_prompt_once_and_draw_apart(stack, session, prompts, tiny_tokenizer):
    """n=3: choice 0 is the n=1 answer; the others are sampled with seeds of their own, and start once
    choice 0 has a token, so P takes the prompt from its prefix cache instead of computing it again."""
    prompt_ids = fresh(tiny_tokenizer, "n choices", prompts[4])
    args = {"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 12, "temperature": 1.0, "seed": 17,
            "logprobs": 1, "extra_body": {"pdd": {"pipeline": "p-rld-md", "handoff_at": 3}}}
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    try:
        three = await client.completions.create(**args, n=3)
        stream = await client.completions.create(**args, n=3, stream=True)
        chunks = [chunk async for chunk in stream]
        one = await client.completions.create(**args)
    finally:
        await client.close()
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) == 3 and texts[0] == one.choices[0].text  # three seeds; the first is n=1's
    assert three.usage.completion_tokens == 36 and three.usage.prompt_tokens == len(prompt_ids)
    assert all(len(c.logprobs.tokens) == 12 for c in three.choices)
    computed = [s["prefill"]["computed_tokens"] for s in three.model_extra["pdd"]["choices"]]
    assert computed[0] > len(prompt_ids) // 2 and computed[1:] == [0, 0], computed  # P computed it once
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts  # the same seeds: the same answers, streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] * 3
