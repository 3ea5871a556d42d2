"""A few hundred malformed requests over gRPC and HTTP, several at a time: each gets a clean
INVALID_ARG naming its field (no traceback, no server path) or, where it happens to be valid, a
completion; none crashes or hangs. Afterwards the server is ready, a normal request gives the
text it gave before, and every KV block is free."""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.sampling_params import SamplingParams
from client.stream import GenerationError, complete
from serving.triton.request_inputs import VLLM_ONLY_PARAMETERS

pytestmark = pytest.mark.server

NUM_CASES = 320
FIELDS = SamplingParams.field_names() | set(VLLM_ONLY_PARAMETERS) | {
    "text_input", "messages", "sampling_parameters", "parameters", "stream", "exclude_input_in_output",
    "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
    "return_cumulative_logprob",
}
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|site-packages|Error\b")
REFERENCE = dict(max_tokens=12, temperature=0.0, ignore_eos=True)

# what the reliability report sent, then what a fuzzer would
REPORTED = [
    {"sampling_parameters": '{"stop_token_ids": [100000], "min_tokens": 2}'},
    {"sampling_parameters": '{"stop_token_ids": [9223372036854775808], "min_tokens": 2}'},
    {"sampling_parameters": '{"stop_token_ids": 5}'},
    {"sampling_parameters": '{"stop_token_ids": null}'},
    {"sampling_parameters": '{"stream": "yes"}'},
    {"sampling_parameters": '{"exclude_input_in_output": {"a": 1}}'},
    {"sampling_parameters": "[" * 30_000},
    {"sampling_parameters": "[" * 100_000},
    {"text_input": None, "messages": "[" * 100_000},
    {"text_input": "x" * 5_000_000},
]
JSON_VALUES = [
    None, True, False, 0, -1, 1, 2, 2**31, 2**63, 2**64, 10**30, -(10**30), 1e-45, 1e-40, 1e308,
    "NaN", "Infinity", "-Infinity", 0.5, -0.5, 3.0, "", "x", "yes", "0.7", "1e999", [], [1, 2], ["a"],
    [""], [None], {}, {"a": 1}, [[1]], [100000], [-1], [2**64],
]


def _json_literal(value) -> str:
    return value if value in ("NaN", "Infinity", "-Infinity") else json.dumps(value)


def _cases(seed: int = 13) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    keys = sorted(FIELDS - {"text_input", "messages", "sampling_parameters"}) + ["n", "beam", "__class__"]
    typed = {
        "temperature": [-1.0, float("nan"), float("inf"), 1e-45, 1e30],
        "top_p": [0.0, -0.1, 1.5, float("nan")],
        "min_p": [-0.5, 2.0, float("nan")],
        "repetition_penalty": [0.0, 1e-40, -1.0, 3.0, float("inf")],
        "presence_penalty": [-3.0, 9.0, float("nan")],
        "frequency_penalty": [3.0, float("-inf")],
        "top_k": [-2, -(2**31)],
        "max_tokens": [0, -1, 2**31 - 1],
        "min_tokens": [-1, 2**31 - 1],
    }
    cases = []
    for i in range(NUM_CASES):
        protocol = "grpc" if i % 2 == 0 else "http"
        kind = i % 8
        if i < 2 * len(REPORTED):
            inputs = dict(REPORTED[i // 2])
        elif kind in (0, 1, 2):  # sampling_parameters with wrong types, ranges and keys
            pairs = [(rng.choice(keys), rng.choice(JSON_VALUES)) for _ in range(rng.randint(1, 3))]
            text = "{" + ", ".join(f"{json.dumps(k)}: {_json_literal(v)}" for k, v in pairs) + "}"
            inputs = {"sampling_parameters": text}
        elif kind == 3:  # not JSON, or JSON of the wrong shape
            inputs = {"sampling_parameters": rng.choice(['{"temperature": 0.5,', "[1, 2]", '"x"', "{]", "nul"])}
        elif kind == 4:  # chat messages of the wrong shape
            bad = ['[{"role": "user", "content": 5}]', '[{"role": 1}]', "[]", '{"role": "user"}', "[{", "[[[[[[[[[[]]]]]]]]]]"]
            inputs = {"text_input": None, "messages": rng.choice(bad)}
        elif kind == 5:  # typed inputs out of range
            name = rng.choice(sorted(typed))
            inputs = {name: rng.choice(typed[name])}
            if name == "min_tokens":
                inputs["max_tokens"] = 4
        elif kind == 6:  # prompts: empty, invalid UTF-8 (gRPC carries raw bytes), past the bound
            choice = rng.randrange(3)
            if choice == 1 and protocol == "grpc":
                inputs = {"text_input": b"\xff\xfe bad \xc3"}
            else:
                inputs = {"text_input": "" if choice == 0 else "word " * 60_000}
        else:  # stops: empty, too many, too long
            inputs = {"stop": rng.choice([[""], ["s"] * 65, ["x" * 1025]])}
        cases.append((protocol, inputs))
    return cases


def _send(server, protocol: str, inputs: dict) -> str:
    """'ok', 'clean' (INVALID_ARG naming a field, nothing leaked), or what went wrong."""
    inputs = {"text_input": "Once upon a time", "max_tokens": 2, **inputs}
    prompt = inputs.pop("text_input")
    url = server.grpc_url if protocol == "grpc" else server.http_url
    try:
        complete(url, prompt, protocol=protocol, stream=protocol == "grpc", timeout=60, **inputs)
    except GenerationError as e:
        message = str(e)
        if "timed out" in message.lower() or "deadline" in message.lower():
            return f"hang: {message[:200]}"
        field = message.split(":", 1)[0]
        if field in FIELDS and not LEAKS.search(message) and e.status in (None, "400"):
            return "clean"
        return f"crash: [{e.status}] {message[:300]}"
    except Exception as e:  # the client itself failed: a broken connection, a timeout
        return f"crash: {type(e).__name__}: {str(e)[:300]}"
    return "ok"


def test_malformed_requests_get_clean_errors_and_harm_nothing(server):
    reference = complete(server.grpc_url, "def main():", **REFERENCE).text
    cases = _cases()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: _send(server, *case), cases))
    counts = {kind: sum(r.startswith(kind) for r in results) for kind in ("clean", "ok", "crash", "hang")}
    print(f"\nserver fuzz: {len(cases)} cases: {counts}")
    problems = [(case, r) for case, r in zip(cases, results) if r not in ("clean", "ok")]
    assert not problems, problems[:5]
    assert counts["clean"] > 0.8 * len(cases)
    assert server.handle.is_ready()
    assert complete(server.grpc_url, "def main():", **REFERENCE).text == reference
    samples = server.wait_for_metrics(
        lambda s: s["specserve_kv_cache_free_blocks"] == s["specserve_kv_cache_total_blocks"]
    )
    assert samples["specserve_kv_cache_free_blocks"] == samples["specserve_kv_cache_total_blocks"]
    assert samples["specserve_num_requests_running"] == samples["specserve_num_requests_waiting"] == 0
