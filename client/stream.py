"""Streaming client for the `llm` model: gRPC bidirectional stream and HTTP generate_stream (SSE).

    for chunk in generate("localhost:8001", "Once upon a time", max_tokens=64, temperature=0):
        print(chunk.text, end="", flush=True)

`generate` yields one Chunk per response (a text delta when streaming, the whole completion
otherwise). Leaving the loop early (break, an exception, Ctrl-C) stops the request on the server:
tritonserver does not pass a cancelled `llm` request on to the engine, so the client sends a stop
request, `abort_request_id` set to the request's id and `abort_key` to the secret sent with the
request (each request gets a fresh id and key: only its sender can stop it), and waits a moment for
the request to end. `complete` gathers a whole request into one Completion.
"""
from __future__ import annotations

import json
import queue
import re
import secrets
import time
import urllib.error
import uuid
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

# Input name -> (Triton datatype, numpy dtype); all optional except a prompt.
INPUT_TYPES: dict[str, tuple[str, type]] = {
    "text_input": ("BYTES", np.object_),
    "messages": ("BYTES", np.object_),
    "stream": ("BOOL", np.bool_),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "min_p": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "min_tokens": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "stop": ("BYTES", np.object_),
    "ignore_eos": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
    "sampling_parameters": ("BYTES", np.object_),
    "return_finish_reason": ("BOOL", np.bool_),
    "return_num_input_tokens": ("BOOL", np.bool_),
    "return_num_output_tokens": ("BOOL", np.bool_),
    "return_logprobs": ("BOOL", np.bool_),
    "return_cumulative_logprob": ("BOOL", np.bool_),
    "abort_key": ("BYTES", np.object_),  # the secret a stop request for this request must carry
}
STOP_INPUT = {"abort_request_id": ("BYTES", np.object_)}  # with abort_key, a stop request's inputs
OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "logprobs", "cumulative_logprob")
ENSEMBLE_ERROR_PREFIX = re.compile(r"^in ensemble '[^']*', ")
STOP_WAIT_S = 2.0  # how long a stopped request is given to end before the stream closes
CANCELLED_BY_STREAM = ("llm_bls",)  # models that see a closed stream themselves: no stop request


class GenerationError(RuntimeError):
    """The server refused or failed the request; `status` is Triton's code when known."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Chunk:
    text: str  # new text (streaming) or the whole completion
    final: bool  # the last response of the request
    finish_reason: str | None = None  # with return_finish_reason, on the last chunk
    num_input_tokens: int | None = None  # with return_num_input_tokens
    num_output_tokens: int | None = None  # with return_num_output_tokens: this chunk's tokens
    # with return_logprobs and the sampling parameter `logprobs`: per token of this chunk,
    # {token id: {"logprob", "rank", "decoded_token"}} for the chosen token and the top n
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None  # with return_cumulative_logprob: the sum so far


@dataclass(slots=True)
class Completion:
    text: str
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason if self.chunks else None

    @property
    def num_output_tokens(self) -> int | None:
        counts = [c.num_output_tokens for c in self.chunks if c.num_output_tokens is not None]
        return sum(counts) if counts else None


def new_abort_key() -> str:
    """A fresh secret for one request's `abort_key`."""
    return secrets.token_hex(16)


def stop_inputs(request_id: str, abort_key: str) -> dict[str, str]:
    """The inputs of the stop request for the request sent with this id and key."""
    return {"abort_request_id": request_id, "abort_key": abort_key}


def request_inputs(
    prompt: str | None = None, messages: list[dict] | str | None = None, **params
) -> dict[str, object]:
    """The request's inputs by name; `params` are the other inputs of `llm` (see INPUT_TYPES).
    A fresh `abort_key` is added unless one is given."""
    values: dict[str, object] = {"abort_key": new_abort_key()}
    if prompt is not None:
        values["text_input"] = prompt
    if messages is not None:
        values["messages"] = messages if isinstance(messages, str) else json.dumps(messages)
    if isinstance(params.get("sampling_parameters"), dict):
        params["sampling_parameters"] = json.dumps(params["sampling_parameters"])
    for name, value in params.items():
        if name not in INPUT_TYPES:
            raise ValueError(f"unknown input {name!r}; inputs: {', '.join(INPUT_TYPES)}")
        if value is not None:
            values[name] = value
    return values


def generate(
    url: str,
    prompt: str | None = None,
    messages: list[dict] | str | None = None,
    protocol: str = "grpc",
    stream: bool = True,
    model: str = "llm",
    timeout: float | None = 600.0,
    **params,
) -> Iterator[Chunk]:
    # the completion alone unless asked (without streaming the server's default echoes the prompt)
    params.setdefault("exclude_input_in_output", True)
    values = request_inputs(prompt, messages, stream=stream, **params)
    if protocol == "grpc":
        return _grpc_generate(url, model, values, timeout)
    if protocol == "http":
        return _http_generate(url, model, values, stream, timeout)
    raise ValueError(f"protocol must be grpc or http, got {protocol!r}")


def complete(url: str, prompt: str | None = None, **kwargs) -> Completion:
    chunks = list(generate(url, prompt, **kwargs))
    return Completion("".join(c.text for c in chunks), chunks)


# -- gRPC: one bidirectional stream per request ---------------------------------------------------
def _grpc_generate(url: str, model: str, values: dict, timeout: float | None) -> Iterator[Chunk]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = grpc_inputs(values)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    request_id = uuid.uuid4().hex
    finished = started = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        started = True
        while not finished:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise GenerationError(f"no response within {timeout} s") from None
            if error is not None:
                finished = True
                status = error.status() if isinstance(error, InferenceServerException) else None
                raise GenerationError(_message(error), status)
            finished = result.get_response().parameters["triton_final_response"].bool_param
            chunk = _chunk({name: result.as_numpy(name) for name in OUTPUTS}, finished)
            if chunk.text or finished:
                yield chunk
    finally:
        if started and not finished and model not in CANCELLED_BY_STREAM:
            _grpc_stop(client, model, request_id, str(values["abort_key"]), responses)
        client.stop_stream(cancel_requests=not finished)
        client.close()


def _grpc_stop(client, model: str, request_id: str, abort_key: str, responses: queue.SimpleQueue) -> None:
    """Send the stop request on the stream, then wait (STOP_WAIT_S at most) for the stopped
    request's last response."""
    try:
        client.async_stream_infer(model, grpc_inputs(stop_inputs(request_id, abort_key)),
                                  request_id=f"{request_id}-stop", enable_empty_final_response=True)
    except Exception:
        return  # the stream is gone: nothing more can be sent
    deadline = time.monotonic() + STOP_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            result, error = responses.get(timeout=left)
        except queue.Empty:
            return
        if result is None:
            continue
        response = result.get_response()
        if response.id == request_id and response.parameters["triton_final_response"].bool_param:
            return


def grpc_inputs(values: dict[str, object]) -> list:
    """tritonclient gRPC inputs for `llm`'s inputs by name (INPUT_TYPES, and abort_request_id)."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        datatype, dtype = (INPUT_TYPES | STOP_INPUT)[name]
        array = _array(name, value, dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _array(name: str, value: object, dtype: type) -> np.ndarray:
    if name == "stop":
        items = [value] if isinstance(value, str) else list(value)
        return np.array([s.encode("utf-8") for s in items], dtype=np.object_)
    if dtype is np.object_:
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
        return np.array([raw], dtype=np.object_)
    return np.array([value], dtype=dtype)


def _message(error: Exception) -> str:
    message = error.message() if hasattr(error, "message") else str(error)
    return _message_text(message)


# -- HTTP: generate (one response) and generate_stream (server-sent events) -------------------------
def _http_generate(
    url: str, model: str, values: dict, stream: bool, timeout: float | None
) -> Iterator[Chunk]:
    base = url if url.startswith("http") else f"http://{url}"
    endpoint = "generate_stream" if stream else "generate"
    request_id = uuid.uuid4().hex
    body = json.dumps(values | {"id": request_id}).encode("utf-8")
    request = urllib.request.Request(
        f"{base}/v2/models/{model}/{endpoint}", body, {"Content-Type": "application/json"}
    )
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise GenerationError(_http_error(e.read()), str(e.code)) from None
    except urllib.error.URLError as e:
        raise GenerationError(f"cannot reach {base}: {e.reason}") from None
    finished = False
    try:
        with response:
            if not stream:
                yield _chunk(json.loads(response.read()), final=True)
                finished = True
                return
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    finished = True
                    raise GenerationError(_message_text(event["error"]))
                yield _chunk(event, final=False)
            finished = True
    finally:
        if not finished and model not in CANCELLED_BY_STREAM:
            _http_stop(base, model, request_id, str(values["abort_key"]))


def _http_stop(base: str, model: str, request_id: str, abort_key: str) -> None:
    """POST the stop request (its answer waited for STOP_WAIT_S at most)."""
    body = json.dumps(stop_inputs(request_id, abort_key)).encode("utf-8")
    request = urllib.request.Request(f"{base}/v2/models/{model}/generate", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=STOP_WAIT_S).close()
    except (urllib.error.URLError, OSError):
        pass  # the server is gone, or slow to answer: the abort was delivered on arrival either way


def _http_error(body: bytes) -> str:
    body = body.strip().removeprefix(b"data:")  # generate_stream answers an early error as an event
    try:
        return _message_text(json.loads(body)["error"])
    except (ValueError, KeyError):
        return body.decode("utf-8", errors="replace")


def _message_text(message: str) -> str:
    """The error without the prefix an ensemble puts on its steps' errors."""
    return ENSEMBLE_ERROR_PREFIX.sub("", message, count=1)


def _chunk(outputs: dict, final: bool) -> Chunk:
    def scalar(name):
        value = outputs.get(name)
        if value is None:
            return None
        if isinstance(value, np.ndarray):
            if value.size == 0:
                return None
            value = value.reshape(-1)[0]
        if isinstance(value, list):
            value = value[0] if value else None
        return value.decode("utf-8") if isinstance(value, bytes) else value

    text = scalar("text_output") or ""
    finish_reason = scalar("finish_reason")
    finish_reason = None if finish_reason in (None, "", "None") else finish_reason  # "None": not yet
    logprobs = scalar("logprobs")
    n_in, n_out = scalar("num_input_tokens"), scalar("num_output_tokens")
    cumulative = scalar("cumulative_logprob")
    return Chunk(
        text=text,
        final=final or finish_reason is not None,
        finish_reason=finish_reason,
        num_input_tokens=None if n_in is None else int(n_in),
        num_output_tokens=None if n_out is None else int(n_out),
        logprobs=json.loads(logprobs) if logprobs else None,
        cumulative_logprob=None if cumulative is None else float(cumulative),
    )
