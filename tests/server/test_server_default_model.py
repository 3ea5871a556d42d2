"""The default model (SmolLM2-135M-Instruct) served as `make serve` serves it: chat through `llm`,
`llm_bls` and the OpenAI API is rendered exactly as `apply_chat_template` renders it, gives real
answers, and the served greedy output equals HF `generate` on the converted checkpoint."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.stream import complete
from scripts.chat_prompts import chat
from tests.server.conftest import DEFAULT_MODEL, openai_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not (DEFAULT_MODEL / "conversion.json").is_file(),
                       reason="run python -m scripts.convert_default_model (make test does)"),
]
QUESTION = chat("What is the capital of France?")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)


@pytest.fixture(scope="module")
def hf_answer(tokenizer):
    """HF generate's greedy answer to QUESTION in float32, and the rendered prompt."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32, local_files_only=True).eval()
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(rendered, add_special_tokens=False).input_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return rendered, ids.shape[1], tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_chat_is_rendered_with_the_template_and_answers_as_hf(smol_server, hf_answer, model):
    rendered, num_prompt_tokens, answer = hf_answer
    assert "Paris" in answer
    params = dict(max_tokens=MAX_TOKENS, temperature=0.0, return_num_input_tokens=True, model=model)
    streamed = complete(smol_server.grpc_url, messages=QUESTION, **params)
    assert streamed.text == answer
    assert streamed.chunks[-1].num_input_tokens == num_prompt_tokens
    echoed = complete(smol_server.grpc_url, messages=QUESTION, stream=False, exclude_input_in_output=False, **params)
    assert echoed.text == rendered + answer


def test_openai_chat_answers_as_hf(smol_server, hf_answer):
    _, num_prompt_tokens, answer = hf_answer
    with openai_server(smol_server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(model="specserve", messages=QUESTION, max_tokens=MAX_TOKENS,
                                               temperature=0)
    assert reply.choices[0].message.content == answer
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == num_prompt_tokens


SEEDED = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)
TOPICS = ["the sea", "bread", "a clock", "rain", "chess", "owls", "tea", "bridges", "snow", "maps", "bees", "jazz"]


def _seeded_then_beside_others(one, other) -> tuple[list[str], str]:
    """`one()` five times in a row, then once while twelve `other(topic)` requests (sampled,
    unseeded) run beside it: the six texts."""
    alone = [one() for _ in range(5)]
    with ThreadPoolExecutor(len(TOPICS) + 1) as pool:
        others = [pool.submit(other, topic) for topic in TOPICS]
        beside = pool.submit(one)
        assert all(f.result() for f in others)
        return alone, beside.result()


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_a_seed_gives_the_same_text_again_and_beside_other_requests(smol_server, model):
    """As served by default (EAGLE head, adaptive k): whatever k the controller picks and whoever
    shares the batch, a seeded request's text does not move."""
    def one() -> str:
        return complete(smol_server.grpc_url, messages=chat("Write a short poem about the moon."), model=model,
                        **SEEDED).text

    def other(topic: str) -> str:
        return complete(smol_server.grpc_url, messages=chat(f"Tell me about {topic}."), model=model,
                        max_tokens=24, temperature=1.0).text

    alone, beside = _seeded_then_beside_others(one, other)
    assert alone == [beside] * 5 and beside
    another_seed = complete(smol_server.grpc_url, messages=chat("Write a short poem about the moon."), model=model,
                            **{**SEEDED, "seed": 1235}).text
    assert another_seed != beside  # the seed does choose the text


def test_a_seed_gives_the_same_text_through_the_openai_api(smol_server):
    with openai_server(smol_server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

        def one() -> str:
            reply = client.completions.create(model="specserve", prompt="import os\n", max_tokens=16,
                                              temperature=0.9, seed=5)
            return reply.choices[0].text

        def other(topic: str) -> str:
            reply = client.chat.completions.create(model="specserve", messages=chat(f"Tell me about {topic}."),
                                                   max_tokens=24, temperature=1.0)
            return reply.choices[0].message.content

        alone, beside = _seeded_then_beside_others(one, other)
        chat_seeded = [client.chat.completions.create(
            model="specserve", messages=chat("Write a short poem about the moon."), **SEEDED).choices[0].message.content
            for _ in range(2)]
    assert alone == [beside] * 5 and beside
    assert chat_seeded[0] == chat_seeded[1] and chat_seeded[0]
