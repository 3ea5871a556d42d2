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
import importlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from client.stream import request_inputs
from serving.experiments.request_log import LATENCIES
from serving.experiments.metrics import VerdictConfig
from serving.experiments.experiment import Experiment
from serving.experiments.rollout import RolloutPlan, load_experiment
from serving.launch.launcher import ADMIN_HEADER  # the operator's admin key, as tritonserver's restricted APIs take it
from serving.launch.launcher import ADMIN_KEY_VARIABLE as ADMIN_KEY_ENV
from serving.gateway.experiment_page import add_experiment_page
from serving.gateway.experiment_gate import ROLLOUT_INTERVAL_S, ExperimentGate
from serving.gateway.guard import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_READS,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    GuardConfig,
    OpenAIGuard,
)
from serving.gateway.protocol import Accumulator, OpenAIError, chat_inputs, completion_inputs
from serving.gateway.chat_template import ChatTemplate
from serving.gateway.tool_parsers import PARSER_NAMES, PARSERS
from serving.gateway.reply import Reply
from serving.gateway.triton_generation import TRITON_MODEL, TritonClient, TritonGeneration

log = logging.getLogger(__name__)


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
    # guided decoding's checker (xgrammar, and torch under it) loads while the gateway already
    # serves; a request that needs it first waits for the import to finish
    threading.Thread(target=importlib.import_module, args=("backend.core.grammar_compiler",),
                     name="warm-up", daemon=True).start()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
