"""An OpenAI-compatible HTTP server in front of tritonserver: /v1/models, /v1/completions and
/v1/chat/completions (streamed as server-sent events, or whole), /health.

Each request is one gRPC stream to the `llm` model (tritonclient's asyncio client, always
streaming: a whole answer is gathered here). A client that goes away mid-request gets its request
stopped on the server (a stop request naming it, README "Stopping a request"), so its KV cache is
freed at once. Translation both ways: serving/gateway/protocol.py.

Every request passes serving/gateway/guard.py first: the API key, JSON bodies only, the body's size
and nesting, and a bound on requests in flight.

With `--experiment FILE` (serving/experiments/experiment.py) the server is an A/B gateway: each request goes
to the arm its sticky key is assigned (the response's `x-specserve-arm` header names it), what it
gave the user is recorded per arm (serving/experiments/recorder.py: the request log of --experiment-log,
Prometheus text on /metrics), the verdict against the control is JSON on GET /v1/experiment (each
arm's latency distribution on /v1/experiment/ecdf?metric=ttft), and POST /v1/experiment/weights
changes the weights at run time with the admin key.

    SPECSERVE_API_KEY=... python -m serving.gateway.server --triton localhost:8001 --port 9000
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aio_grpcclient
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from client.stream import (
    ENSEMBLE_ERROR_PREFIX,
    INPUT_TYPES,
    OUTPUTS,
    STOP_INPUT,
    grpc_inputs,
    request_inputs,
    stop_inputs,
)
from serving.experiments.request_log import LATENCIES
from serving.experiments.recorder import ExperimentRecorder
from serving.experiments.metrics import VerdictConfig
from serving.experiments.experiment import Assignment, Experiment, ExperimentError
from serving.experiments.rollout import Rollout, RolloutPlan, load_experiment
from serving.launch.launcher import ADMIN_HEADER  # the operator's admin key, as tritonserver's restricted APIs take it
from serving.launch.launcher import ADMIN_KEY_VARIABLE as ADMIN_KEY_ENV
from serving.gateway.experiment_page import add_experiment_page
from serving.gateway.guard import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_READS,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    GuardConfig,
    OpenAIGuard,
)
from serving.gateway.protocol import (
    Accumulator,
    GenerationRequest,
    OpenAIError,
    chat_inputs,
    chat_logprobs,
    completion_inputs,
    completion_logprobs,
)
from serving.gateway.chat_template import ChatTemplate
from serving.gateway.tool_parsers import PARSER_NAMES, PARSERS
from serving.gateway.tool_stream import ToolStream

TRITON_MODEL = "llm"
log = logging.getLogger(__name__)
ROLLOUT_INTERVAL_S = 10.0
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


class ExperimentGate:
    """An A/B experiment in front of the arms: which arm serves a request, what it gave the user,
    the requests in flight on each arm (a rollout rolls back an arm that stops answering), and weight
    changes at run time (the admin key's, compared in constant time)."""

    def __init__(self, experiment: Experiment, admin_key: str | None, rollout: RolloutPlan | None = None,
                 config: VerdictConfig | None = None, log_path: str | None = None):
        self.recorder = ExperimentRecorder(experiment, config, log_path)  # holds the weights as they are now
        self.admin_key = admin_key
        self.rollout = Rollout(rollout, self.recorder) if rollout is not None else None
        self.in_flight: dict[TritonGeneration, str] = {}  # -> the arm serving it

    @property
    def experiment(self) -> Experiment:
        return self.recorder.experiment

    def stalled_s(self, arm: str) -> float:
        """How long the arm's longest-waiting request in flight has gone without a token."""
        now = time.monotonic()
        return max((now - (g.last_token_at or g.started) for g, a in self.in_flight.items()
                    if a == arm and g.reader is not None and not g.done.is_set()), default=0.0)

    async def guard_rollout(self, interval_s: float) -> None:
        """Judge the rollout every interval_s; it moves the weights on an advance or rollback."""
        while self.rollout is not None and not self.rollout.finished:
            await asyncio.sleep(interval_s)
            decision = self.rollout.evaluate(self.stalled_s(self.rollout.plan.arm))
            if decision.action != "hold":
                log.info("experiment %s rollout: %s to %s%% (%s): %s", self.experiment.name, decision.action,
                         decision.percent, decision.reason, json.dumps(decision.evidence))

    def report(self) -> dict:
        report = self.recorder.report()
        if self.rollout is not None:
            report["rollout"] = self.rollout.to_dict()
        return report

    def key(self, request: Request, body: dict) -> str | None:
        source = self.experiment.sticky_key
        if source == "user":
            key = body.get("user")
        elif source.startswith("header:"):
            key = request.headers.get(source.split(":", 1)[1])
        else:
            key = body.get(source.split(":", 1)[1])
        return str(key) if key is not None else None

    def start(self, assignment: Assignment, generation: TritonGeneration) -> None:
        if assignment.in_experiment:
            self.in_flight[generation] = assignment.arm.name

    def record(self, assignment: Assignment, key: str | None, generation: TritonGeneration, status: str,
               finish_reason: str | None = None) -> None:
        """How a request ended: status ok, error, client_error (a 4xx) or cancelled; once a request."""
        if self.in_flight.pop(generation, None) is None:
            return  # held out, or already recorded
        first, last, n = generation.first_token_at, generation.last_token_at, generation.output_tokens
        self.recorder.record(assignment.arm.name, key, status, finish_reason,
                             None if first is None else first - generation.started,
                             (last - first) / (n - 1) if first is not None and n > 1 else None,
                             time.monotonic() - generation.started, n)

    def set_weights(self, request: Request, weights: Any) -> None:
        given = request.headers.get(ADMIN_HEADER, "")
        if self.admin_key is None or not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise OpenAIError(f"changing an experiment needs the admin key (header {ADMIN_HEADER})", 403,
                              kind="permission_error")
        if not isinstance(weights, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in weights.values()):
            raise OpenAIError('the body must be {"weights": {arm: number, ...}}', param="weights")
        if self.rollout is not None and not self.rollout.finished:
            raise OpenAIError("a rollout sets the weights until it ends", 409, param="weights")
        try:
            self.recorder.set_weights(weights)
        except ExperimentError as e:
            raise OpenAIError(str(e), param="weights") from None


def create_app(triton_url: str, served_model: str, guard: GuardConfig | None = None,
               experiment: Experiment | None = None, admin_key: str | None = None,
               rollout: RolloutPlan | None = None, rollout_interval_s: float = ROLLOUT_INTERVAL_S,
               verdict: VerdictConfig | None = None, experiment_log: str | None = None,
               template: ChatTemplate | None = None, tool_call_parser: str | None = None) -> FastAPI:
    gate = ExperimentGate(experiment, admin_key, rollout, verdict, experiment_log) if experiment is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(gate.guard_rollout(rollout_interval_s)) if gate and gate.rollout else None
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="specserve OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(OpenAIGuard, config=guard or GuardConfig())
    triton = TritonClient(triton_url)
    parser = PARSERS[tool_call_parser] if tool_call_parser else None
    read_chat = lambda body: chat_inputs(body, template, parser)  # noqa: E731

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await _ready(triton.get())
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": 0,
                                            "owned_by": "specserve"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, triton.get(), served_model, "text_completion", completion_inputs, gate)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, triton.get(), served_model, "chat.completion", read_chat, gate)

    if gate is not None:
        @app.get("/v1/experiment")
        async def experiment_report() -> JSONResponse:
            return JSONResponse(await asyncio.to_thread(gate.report))

        @app.get("/v1/experiment/ecdf")
        async def experiment_ecdf(metric: str = "ttft") -> JSONResponse:
            if f"{metric}_s" not in LATENCIES:
                raise OpenAIError("metric must be one of ttft, itl, e2e", param="metric")
            return JSONResponse(await asyncio.to_thread(gate.recorder.ecdf, f"{metric}_s"))

        @app.post("/v1/experiment/weights")
        async def experiment_weights(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                raise OpenAIError("the body is not valid JSON") from None
            gate.set_weights(request, body.get("weights") if isinstance(body, dict) else None)
            return JSONResponse({"weights": {a.name: a.weight for a in gate.experiment.arms}})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(gate.recorder.prometheus())

    return app


async def _ready(client) -> bool:
    try:
        return bool(await client.is_server_ready()) and bool(await client.is_model_ready(TRITON_MODEL))
    except Exception:
        return False


async def _serve(request: Request, client, served_model: str, kind: str, parse, gate: ExperimentGate | None) -> Any:
    try:
        body = await request.json()
    except ValueError:
        raise OpenAIError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    model = body.get("model")
    if model not in (None, served_model):
        raise OpenAIError(f"model {model!r} does not exist; this server serves {served_model!r}", 404,
                          param="model", kind="not_found_error")
    generation_request = parse(body)
    inputs = request_inputs(**generation_request.inputs, stream=True, exclude_input_in_output=True,
                            return_finish_reason=True, return_num_input_tokens=True,
                            return_num_output_tokens=True, return_logprobs=generation_request.logprobs is not None,
                            sampling_parameters=generation_request.sampling_parameters())
    # a constraint `llm` refuses is named as the client wrote it
    constraint = "tool_choice" if generation_request.tools is not None and generation_request.tools.forced \
        else "response_format"
    key = gate.key(request, body) if gate is not None else None
    assignment = gate.experiment.assign(key) if gate is not None else None
    model = assignment.arm.model if assignment is not None else TRITON_MODEL
    generation = TritonGeneration(client, inputs, constraint, model)
    reply = Reply(kind, served_model, generation_request)
    record = None
    if gate is not None:
        gate.start(assignment, generation)
        record = lambda status, finish=None: gate.record(assignment, key, generation, status, finish)  # noqa: E731
    headers = {"x-specserve-arm": assignment.arm.name} if assignment is not None else None
    if generation_request.stream:
        return StreamingResponse(_events(request, generation, reply, record), media_type="text/event-stream",
                                 headers=headers)
    try:
        return JSONResponse(await _whole(request, generation, reply, record), headers=headers)
    except OpenAIError as error:  # an error answer names its arm too
        return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _whole(request: Request, generation: TritonGeneration, reply: Reply, record=None) -> dict:
    """Gather the answer; stop it on the server if the client leaves first. `record(status,
    finish reason)` is told how it ended (an experiment's measurement)."""
    gathered = Accumulator()
    watcher = asyncio.create_task(_watch_disconnect(request, generation))
    outcome = "cancelled"  # until the answer or an error comes
    try:
        async for outputs in generation.responses():
            gathered.add(outputs)
        outcome = "ok"
    except OpenAIError as error:
        outcome = _status(error)
        raise
    finally:
        if watcher.done():  # the client left and the request was stopped
            outcome = "cancelled"
        watcher.cancel()
        if record is not None:
            record(outcome, gathered.finish_reason or "stop")
    return reply.whole(gathered)


def _status(error: OpenAIError) -> str:
    """An experiment's name for how a request failed: the client's mistake (4xx) or the server's."""
    return "client_error" if 400 <= error.status < 500 else "error"


async def _watch_disconnect(request: Request, generation: TritonGeneration) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    await generation.stop()


async def _events(request: Request, generation: TritonGeneration, reply: Reply, record=None) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels this generator: the request is stopped."""
    gathered = Accumulator()
    offset = 0  # characters streamed so far (the logprobs' text_offset)
    try:
        yield _event(reply.chunk(role=True))
        async for outputs in generation.responses():
            delta = gathered.add(outputs)
            if reply.tool_stream is not None:
                for chunk in reply.tool_chunks(delta):
                    yield _event(chunk)
            elif delta.text or delta.finish_reason or delta.logprobs:
                yield _event(reply.chunk(delta=delta, offset=offset))
            offset += len(delta.text)
        if record is not None:
            record("ok", gathered.finish_reason or "stop")
        if reply.request.include_usage:
            yield _event(reply.usage_chunk(gathered))
        yield "data: [DONE]\n\n"
    except OpenAIError as error:
        if record is not None:
            record(_status(error))
        yield _event(error.body())
    except (asyncio.CancelledError, GeneratorExit):
        await asyncio.shield(generation.stop())
        raise
    finally:
        if record is not None:
            record("cancelled")  # unless recorded above: the client left


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """The OpenAI objects of one request: whole completions, stream chunks, the usage chunk."""

    def __init__(self, kind: str, model: str, request: GenerationRequest):
        self.kind, self.model, self.request = kind, model, request
        self.id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tool_stream = ToolStream(request.tools) if request.tools is not None else None

    def _base(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, gathered: Accumulator) -> dict:
        text = "".join(gathered.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gathered.finish_reason or "stop"}
        if self.kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
            if self.request.tools is not None:
                content, calls = self.request.tools.parse(text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": [call.openai() for call in calls]}
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = self._chat_logprobs(gathered.logprobs)
        else:
            prefix = self.request.echo_prompt or ""
            choice["text"] = prefix + text
            choice["logprobs"] = self._completion_logprobs(gathered.logprobs, len(prefix))
        return self._base(self.kind) | {"choices": [choice], "usage": gathered.usage()}

    def chunk(self, delta=None, offset: int = 0, role: bool = False) -> dict:
        text = "" if delta is None else delta.text
        finish = None if delta is None else delta.finish_reason
        logprobs = [] if delta is None else delta.logprobs
        if self.kind == "chat.completion":
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""} if role else {"content": text},
                      "logprobs": self._chat_logprobs(logprobs) if logprobs else None, "finish_reason": finish}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        if role:
            text = self.request.echo_prompt or ""
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": self._completion_logprobs(logprobs, offset) if logprobs else None}
        return self._base("text_completion") | {"choices": [choice]}

    def tool_chunks(self, delta) -> list[dict]:
        """A response's chunks when the answer may be a tool call (serving/gateway/tool_calls.py)."""
        stream = self.tool_stream
        deltas = stream.feed(delta.text)
        if delta.finish_reason:
            deltas += stream.finish()
        chunks = [self._chat_chunk(d, None, self._chat_logprobs(delta.logprobs) if i == 0 and delta.logprobs else None)
                  for i, d in enumerate(deltas)]
        if delta.finish_reason:
            finish = "tool_calls" if stream.called and delta.finish_reason == "stop" else delta.finish_reason
            chunks.append(self._chat_chunk({}, finish, None))
        return chunks

    def _chat_chunk(self, message_delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "delta": message_delta, "logprobs": logprobs, "finish_reason": finish}
        return self._base("chat.completion.chunk") | {"choices": [choice]}

    def usage_chunk(self, gathered: Accumulator) -> dict:
        object_name = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        return self._base(object_name) | {"choices": [], "usage": gathered.usage()}

    def _chat_logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.request.logprobs is None else chat_logprobs(entries, self.request.logprobs)

    def _completion_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        return None if self.request.logprobs is None else completion_logprobs(entries, self.request.logprobs, offset)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton", default="localhost:8001", help="tritonserver's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--served-model-name", default="specserve", help="the model name clients send")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"clients must send `Authorization: Bearer KEY` (every route but /health); default: "
                        f"${API_KEY_ENV}, else no key. Prefer the variable: a flag shows in `ps`")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="a larger body is a 413 before it is read on: this bounds the memory each request "
                        "holds; 1 MiB (the default) holds a prompt of some 250k tokens")
    p.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   help="generation requests in flight (streams until their last event); more get a 429 "
                        "with Retry-After at once. Far above what the engine batches, it bounds the "
                        "connections, bodies and gRPC streams held (default: %(default)s)")
    p.add_argument("--experiment", default=None,
                   help="an A/B experiment file (serving/experiments/experiment.py): requests are split over its arms, each "
                        "arm's latencies are recorded (/metrics, /v1/experiment)")
    p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                   help=f"the key (header {ADMIN_HEADER}) that may change the experiment's weights; default: "
                        f"${ADMIN_KEY_ENV}, else none may")
    p.add_argument("--rollout-interval", type=float, default=ROLLOUT_INTERVAL_S,
                   help="seconds between judgements of the experiment's rollout (its \"rollout\" key)")
    p.add_argument("--experiment-log", default=None,
                   help="the experiment's request log (JSON lines, rotated); beside it the weights and the rollout's "
                        "state, so a restart resumes both (docs/experiments.md)")
    p.add_argument("--experiment-page", action="store_true",
                   help="serve the experiment's live page on /experiment (serving/gateway/experiment_page.py)")
    p.add_argument("--max-concurrent-reads", type=int, default=DEFAULT_MAX_CONCURRENT_READS,
                   help="of --max-concurrent-requests, reads (GET /v1/experiment, /metrics, ...) at most "
                        "(default: %(default)s): a flood of them leaves the rest to generation")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer directory: a chat template that takes tools renders them "
                        "(docs/guided-decoding.md); default: the system-prompt rendering")
    p.add_argument("--tool-call-parser", choices=PARSER_NAMES, default=None,
                   help="the format of calls in tool_choice auto (default: the template's, else hermes)")
    args = p.parse_args()
    try:
        guard = GuardConfig(args.api_key, args.max_body_bytes, args.max_concurrent_requests, args.max_concurrent_reads)
        experiment, verdict, rollout = load_experiment(args.experiment) if args.experiment else (None, None, None)
    except ValueError as e:
        p.error(str(e))
    if guard.api_key is None:
        logging.warning("no API key (--api-key or $%s): anyone who reaches port %d can use it", API_KEY_ENV, args.port)
    if rollout is not None and args.experiment_log is None:
        logging.warning("a rollout without --experiment-log starts over if the gateway restarts")
    try:
        app = create_app(args.triton, args.served_model_name, guard, experiment, args.admin_key, rollout,
                         args.rollout_interval, verdict, args.experiment_log,
                         ChatTemplate.load(args.tokenizer) if args.tokenizer else None, args.tool_call_parser)
    except ValueError as e:  # an experiment log that is another experiment's
        p.error(str(e))
    if args.experiment_page and experiment is not None:
        add_experiment_page(app)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
