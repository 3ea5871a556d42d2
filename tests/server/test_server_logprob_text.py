"""Logprobs spell the text on every entry point, streamed and not: the chosen tokens of every
response's logprob entries join to exactly that response's text, for an answer that ends at EOS
(whose token spells ""), at a stop string (the text is cut where it begins; the tokens that carry
it keep their entries and spell only what the text kept) and at max_tokens.

`llm` and `llm_bls` give vllm_backend's entries ({id: {"logprob", "rank", "decoded_token"}} per
token), the OpenAI API its logprobs (completions' `tokens`, chat's `content`), and `ensemble`
TensorRT-LLM's `output_log_probs`: one value per token of the response. The default model, an
instruct model, ends its chat answers at EOS."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from client.stream import complete
from scripts.chat_prompts import chat
from tests.server.conftest import DEFAULT_MODEL, openai_server
from tests.server.test_server_trtllm_clients import run_ensemble, tensors

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not (DEFAULT_MODEL / "conversion.json").is_file(),
                       reason="run python -m scripts.convert_default_model (make test does)"),
]
QUESTION = chat("Say hello in five words.")
MAX_TOKENS = 48  # the answer ends at EOS well before
LENGTH = 4  # max_tokens of the answer cut by length
NUM_LOGPROBS = 2
ENDINGS = ("eos", "stop", "length")
STREAM = [pytest.param(True, id="streamed"), pytest.param(False, id="whole")]


@dataclass(frozen=True)
class Ending:
    values: dict  # the sampling values that make it
    tokens: list[str]  # what each token of the answer spells
    reason: str  # the finish reason

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def _chosen(entry: dict) -> dict:
    """vllm_backend's entry: the chosen token's, which is the one `llm` puts first."""
    return next(iter(entry.values()))


@pytest.fixture(scope="module")
def answer(smol_server) -> list[tuple[str, float]]:
    """The greedy answer as `llm` streams it: each token's text and logprob, the last its EOS."""
    reply = complete(smol_server.grpc_url, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS,
                     sampling_parameters={"logprobs": 0}, return_logprobs=True, return_finish_reason=True)
    tokens = [(_chosen(e)["decoded_token"], _chosen(e)["logprob"]) for c in reply.chunks for e in c.logprobs]
    assert reply.finish_reason == "stop" and len(tokens) < MAX_TOKENS and tokens[-1][0] == ""
    assert "".join(t for t, _ in tokens) == reply.text
    return tokens


@pytest.fixture(scope="module")
def endings(answer) -> dict[str, Ending]:
    """The answer ended at EOS, at a stop string and at max_tokens. The stop string begins inside
    a word and runs into the next: the token where it begins spells only its head, the one that
    completes it spells nothing."""
    words = [t for t, _ in answer]
    i = next(i for i in range(len(words) // 2, len(words) - 1) if len(words[i]) >= 4 and words[i + 1])
    stop = words[i][2:] + words[i + 1][:2]
    cut = Ending({"max_tokens": MAX_TOKENS, "stop": [stop]}, words[:i] + [words[i][:2], ""], "stop")
    assert "".join(words).find(stop) == len(cut.text)
    return {
        "eos": Ending({"max_tokens": MAX_TOKENS}, words, "stop"),
        "stop": cut,
        "length": Ending({"max_tokens": LENGTH}, words[:LENGTH], "length"),
    }


@pytest.fixture(scope="module")
def rendered() -> str:
    """QUESTION rendered with the chat template: a text prompt the model answers as the chat."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)
    return tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)


def _check(responses: list[tuple[str, list[str]]], ending: Ending) -> None:
    """Each response's tokens spell its text; together they are the answer's tokens."""
    for text, tokens in responses:
        assert "".join(tokens) == text
    assert [t for _, tokens in responses for t in tokens] == ending.tokens


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stream", STREAM)
@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_vllm_backend_entries_spell_the_text(smol_server, endings, model, stream, ending):
    end = endings[ending]
    reply = complete(smol_server.grpc_url, messages=QUESTION, model=model, stream=stream, temperature=0,
                     sampling_parameters=end.values | {"logprobs": NUM_LOGPROBS}, return_logprobs=True,
                     return_finish_reason=True, return_num_output_tokens=True)
    assert reply.finish_reason == end.reason
    for chunk in reply.chunks:
        assert len(chunk.logprobs) == chunk.num_output_tokens
        assert all(1 <= len(e) <= NUM_LOGPROBS + 1 for e in chunk.logprobs)
    _check([(c.text, [_chosen(e)["decoded_token"] for e in c.logprobs]) for c in reply.chunks], end)


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stream", STREAM)
def test_tensorrt_llm_log_probs_follow_the_text(smol_server, answer, endings, rendered, stream, ending):
    """`ensemble` on the rendered chat: each response's output_log_probs are those of the tokens
    that spell its text, and cum_log_probs their running sum."""
    end = endings[ending]
    inputs = {
        "text_input": np.array([[rendered]], dtype=object),
        "max_tokens": np.array([[end.values["max_tokens"]]], np.int32),
        "top_k": np.array([[1]], np.int32), "stream": np.array([[stream]]), "return_log_probs": np.array([[True]]),
        "exclude_input_in_output": np.array([[True]]),
    } | ({"stop_words": np.array([end.values["stop"]], dtype=object)} if "stop" in end.values else {})
    tokens = iter(zip(end.tokens, (lp for _, lp in answer)))  # the tokens, with `llm`'s logprobs
    responses, total = [], 0.0
    for result in run_ensemble(smol_server, tensors(inputs)):
        log_probs = result.as_numpy("output_log_probs").reshape(-1).tolist()
        spelled = [next(tokens) for _ in log_probs]
        assert log_probs == pytest.approx([lp for _, lp in spelled], abs=1e-3)
        total += sum(log_probs)
        assert result.as_numpy("cum_log_probs").reshape(-1)[0] == pytest.approx(total, abs=1e-3)
        responses.append((result.as_numpy("text_output")[0].decode(), [t for t, _ in spelled]))
    assert len(responses) == 1 or stream
    _check(responses, end)


@pytest.fixture(scope="module")
def openai_client(smol_server):
    with openai_server(smol_server) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stream", STREAM)
def test_openai_completions_logprobs_spell_the_text(openai_client, endings, rendered, stream, ending):
    end = endings[ending]
    reply = openai_client.completions.create(model="specserve", prompt=rendered, temperature=0,
                                             logprobs=NUM_LOGPROBS, stream=stream, **end.values)
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    assert choices[-1].finish_reason == end.reason
    responses = [(c.text, c.logprobs.tokens if c.logprobs else []) for c in choices]
    _check(responses, end)
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for _, ts in responses for t in ts]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("stream", STREAM)
def test_openai_chat_logprobs_spell_the_text(openai_client, endings, stream, ending):
    end = endings[ending]
    reply = openai_client.chat.completions.create(model="specserve", messages=QUESTION, temperature=0,
                                                  logprobs=True, top_logprobs=NUM_LOGPROBS, stream=stream,
                                                  **end.values)
    if stream:
        choices = [c.choices[0] for c in reply if c.choices]
        responses = [(c.delta.content or "", [t.token for t in c.logprobs.content] if c.logprobs else [])
                     for c in choices]
    else:
        choices = reply.choices
        responses = [(choices[0].message.content, [t.token for t in choices[0].logprobs.content])]
    assert choices[-1].finish_reason == end.reason
    _check(responses, end)
