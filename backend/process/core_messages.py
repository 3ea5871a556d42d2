"""The messages of the engine-core channel (backend/process/engine_core.py), typed: each side decodes what
it receives into one of the messages it expects (backend/parallel/wire.py), or refuses it.

    requests    client -> core: AddRequest | AbortRequest | StopRequest
    outputs     core -> client: Ready (once the engine is built) or Failed; then Output per
                request output, Stats now and then, Dead once a fatal fault has ended every request
"""
from __future__ import annotations

import msgspec

from backend.core.request_limits import RequestLimits
from backend.outputs import EngineStats, RequestOutput
from backend.parallel.wire import Decoder
from backend.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class StopRequest(msgspec.Struct, frozen=True, tag="stop"):
    pass


class Ready(msgspec.Struct, frozen=True, tag="ready"):  # the engine is built
    limits: RequestLimits
    stats: EngineStats


class Failed(msgspec.Struct, frozen=True, tag="failed"):  # the engine could not be built
    message: str


class Output(msgspec.Struct, frozen=True, tag="output"):
    output: RequestOutput


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    stats: EngineStats


class Dead(msgspec.Struct, frozen=True, tag="dead"):  # a fatal fault has ended every request
    pass


REQUESTS: Decoder[AddRequest | AbortRequest | StopRequest] = Decoder(
    AddRequest | AbortRequest | StopRequest, "an engine-core request")
OUTPUTS: Decoder[Ready | Failed | Output | Stats | Dead] = Decoder(
    Ready | Failed | Output | Stats | Dead, "an engine-core output")
