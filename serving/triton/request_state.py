"""What `llm_engine` keeps of one request between its engine outputs and its responses."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestState:
    request_id: str  # the engine's id
    sender: object  # pb_utils.InferenceResponseSender
    lane: int  # index of the sender lane that sends its responses
    triton_request_id: str  # the id the client gave the request ("" if none), for abort_request_id
    abort_key_digest: bytes  # SHA-256 of the request's abort_key (b"": no stop request can end it)
    options: dict  # stream, exclude_input_in_output, return_* flags (see preprocessing)
    prompt_text: str
    arrival: float  # time.monotonic() when execute() received the request
    last_token_time: float | None = None
    cancelled: bool = False
    text: list[str] = field(default_factory=list)  # not streaming: the completion so far
    logprobs: list[dict] = field(default_factory=list)  # not sent yet
    unsent_tokens: int = 0  # tokens generated since the last response
    echo_pending: bool = False  # the prompt still has to precede the next text
    abandoned: bool = False  # its receiver is stuck: nothing more is sent
    started: bool = False  # its first output has come (AdmissionGate)
