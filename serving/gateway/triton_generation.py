"""One generation through tritonserver's `llm` model for the gateway: a gRPC stream per request,
its responses as dicts, a stop that ends it, and Triton's errors as OpenAI's.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aio_grpcclient

from client.stream import ENSEMBLE_ERROR_PREFIX, INPUT_TYPES, OUTPUTS, STOP_INPUT, grpc_inputs, stop_inputs
from serving.gateway.protocol import OpenAIError

TRITON_MODEL = "llm"


STOP_WAIT_S = 2.0  # a stopped request's last response is awaited this long before the stream closes


UNAVAILABLE = ("unavailable", "Exceeds maximum queue size", "shutting down")


class TritonGeneration:
    """One `llm` request over its own gRPC stream, read by a task of its own; `stop()` sends the
    stop request on the stream and waits (STOP_WAIT_S at most) for the request to end."""

    def __init__(self, client: aio_grpcclient.InferenceServerClient, inputs: dict[str, Any],
                 constraint: str = "response_format", model: str = TRITON_MODEL):
        self.client = client
        self.constraint = constraint  # the parameter a guided_decoding error is about
        self.model = model  # `llm`, or an experiment's arm with its interface
        self.started = time.monotonic()
        self.first_token_at: float | None = None  # when the first, and the latest, tokens came
        self.last_token_at: float | None = None
        self.output_tokens = 0
        self.request_id = uuid.uuid4().hex
        self.abort_key = str(inputs["abort_key"])  # request_inputs made a fresh one: only this server can stop it
        self.outgoing: asyncio.Queue = asyncio.Queue()  # requests to send; None ends the stream
        self.outgoing.put_nowait(_request(self.request_id, _tensors(inputs), model))
        self.incoming: asyncio.Queue = asyncio.Queue()  # outputs by name, or an OpenAIError
        self.done = asyncio.Event()  # the request's last response (or an error) has come
        self.reader: asyncio.Task | None = None

    async def _requests(self) -> AsyncIterator[dict]:
        while (item := await self.outgoing.get()) is not None:
            yield item

    async def _read(self) -> None:
        try:
            async for result, error in self.client.stream_infer(self._requests()):
                if error is not None:
                    self.incoming.put_nowait(_triton_error(error.message()))
                    return
                response = result.get_response()
                if response.id != self.request_id:
                    continue  # the stop request's own answer
                outputs = {name: _scalar(result.as_numpy(name)) for name in OUTPUTS}
                if outputs.get("num_output_tokens"):
                    self.last_token_at = time.monotonic()
                    self.first_token_at = self.first_token_at or self.last_token_at
                    self.output_tokens += int(outputs["num_output_tokens"])
                flag = response.parameters.get("triton_final_response")
                final = (flag is not None and flag.bool_param) or outputs["finish_reason"] not in (None, "", "None")
                self.incoming.put_nowait(outputs | {"final": final})
                if final:
                    return
        except Exception as e:  # the stream broke: tritonserver went away
            self.incoming.put_nowait(OpenAIError(f"the inference server is unreachable: {e}", 503, kind="server_error"))
        finally:
            self.done.set()
            self.outgoing.put_nowait(None)

    async def responses(self) -> AsyncIterator[dict[str, Any]]:
        """Each response's outputs by name (with "final"); an OpenAIError for an error response."""
        self.reader = asyncio.create_task(self._read())
        while True:
            item = await self.incoming.get()
            if isinstance(item, OpenAIError):
                if item.param == "guided_decoding":
                    item.param = self.constraint
                raise item
            yield item
            if item["final"]:
                return

    async def stop(self) -> None:
        """Have the server stop this request (its client went away)."""
        if self.done.is_set():
            return
        self.outgoing.put_nowait(_request(f"{self.request_id}-stop", _tensors(stop_inputs(self.request_id, self.abort_key)),
                                          self.model))
        try:
            await asyncio.wait_for(self.done.wait(), STOP_WAIT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            if self.reader is not None:
                self.reader.cancel()


def _request(request_id: str, tensors: list, model: str = TRITON_MODEL) -> dict:
    return {"model_name": model, "inputs": tensors, "request_id": request_id}


def _tensors(values: dict[str, Any]) -> list:
    """The gRPC inputs; a number input that is not one is a 400 naming it."""
    for name, value in values.items():
        datatype, dtype = (INPUT_TYPES | STOP_INPUT)[name]
        if dtype is np.object_:
            continue
        if isinstance(value, (str, list, dict)) or (dtype is not np.bool_ and isinstance(value, bool)):
            raise OpenAIError(f"{name} must be a {datatype.lower()}", param=name)
        try:
            np.array([value], dtype=dtype)
        except (ValueError, TypeError, OverflowError):
            raise OpenAIError(f"{name} must be a {datatype.lower()}", param=name) from None
    return grpc_inputs(values)


def _scalar(array) -> Any:
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _triton_error(message: str) -> OpenAIError:
    message = message.split("] ", 1)[-1] if message.startswith("[request id") else message
    message = ENSEMBLE_ERROR_PREFIX.sub("", message, count=1)
    if any(marker in message for marker in UNAVAILABLE):
        return OpenAIError(message, 503, kind="server_error")
    field, _, rest = message.partition(": ")
    if rest and " " not in field:  # INVALID_ARG: "<input>: <what is allowed>"
        return OpenAIError(message, 400, param=field)
    return OpenAIError(message, 500, kind="server_error")


class TritonClient:
    """tritonclient's asyncio client, made on first use: inside the server's event loop."""

    def __init__(self, url: str):
        self.url = url
        self.client: aio_grpcclient.InferenceServerClient | None = None

    def get(self) -> aio_grpcclient.InferenceServerClient:
        if self.client is None:
            self.client = aio_grpcclient.InferenceServerClient(self.url)
        return self.client
