"""One request to a decoupled model of this server, on a gRPC stream of its own to the server's
own gRPC endpoint: what llm_bls uses instead of a BLS call.

tritonserver 2.51's Python backend receives a decoupled BLS call's responses on a C++ thread of
the calling model's stub process, beside that model's Python threads. Under a few dozen such
streams at once the stub's heap was corrupted (`malloc_consolidate(): unaligned fastbin chunk
detected`, `double free or corruption`, a segmentation fault in `Stub::ProcessBLSResponseDecoupled`)
and the stub died. A gRPC stream is received by grpcio's own threads, which take the GIL as any
Python extension does. It also holds no thread of the python backend's pool while it waits.

The endpoint: the model's `engine_grpc_url` parameter if set, else $SPECSERVE_GRPC_URL (the
launcher sets it to the server's own), else tritonserver's default, 127.0.0.1:8001.
"""
from __future__ import annotations

import os
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

GRPC_URL_VARIABLE = "SPECSERVE_GRPC_URL"
DEFAULT_GRPC_URL = "127.0.0.1:8001"  # tritonserver's default gRPC port


def engine_grpc_url(parameter: str = "") -> str:
    return parameter or os.environ.get(GRPC_URL_VARIABLE) or DEFAULT_GRPC_URL


class StreamError(Exception):
    """The engine's error response, or the stream could not be opened or broke."""


class Interrupted(Exception):
    """`interrupt()` was called while a response was awaited."""


_INTERRUPT = object()


class EngineStream:
    """Send one request and read its responses in order: `next()` returns each response's
    outputs by name and whether it is the last; `close()` ends the stream (cancelling the request
    in the server if it has not ended)."""

    def __init__(self, url: str, model: str, request_id: str, inputs: dict[str, np.ndarray]):
        self.finished = False
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._client = grpcclient.InferenceServerClient(url)
        try:
            self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
            self._client.async_stream_infer(
                model, [_infer_input(name, array) for name, array in inputs.items()],
                request_id=request_id, enable_empty_final_response=True,
            )
        except InferenceServerException as e:
            self.close()
            raise StreamError(f"cannot reach {model} at {url}: {e.message()}") from e

    def next(self, timeout: float | None = None) -> tuple[dict[str, np.ndarray], bool]:
        """The next response's outputs and whether it is the last. Raises StreamError for an
        error response (the last) or when none comes within `timeout` seconds (None: no limit),
        Interrupted if `interrupt()` was called."""
        try:
            item = self._responses.get(timeout=timeout)
        except queue.Empty:
            raise StreamError(f"no response within {timeout} s") from None
        if item is _INTERRUPT:
            raise Interrupted
        result, error = item
        if error is not None:
            self.finished = True
            raise StreamError(error.message() if isinstance(error, InferenceServerException) else str(error))
        response = result.get_response()
        self.finished = response.parameters["triton_final_response"].bool_param
        return {output.name: result.as_numpy(output.name) for output in response.outputs}, self.finished

    def interrupt(self) -> None:
        """Make the pending (or the next) `next()` raise Interrupted; any thread may call it."""
        self._responses.put(_INTERRUPT)

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=not self.finished)
        self._client.close()


def _infer_input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor
