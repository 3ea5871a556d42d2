"""What a server drives an engine through, whichever way the engine runs: on a thread of the
server's own process (backend/engine_loop.py: EngineLoop) or in a process of its own
(backend/process/engine_core_client.py: EngineCoreClient). serving/triton/llm_engine.py holds one of
them and uses nothing else of it."""
from __future__ import annotations

from typing import Callable, Protocol

from backend.outputs import EngineStats, RequestOutput
from backend.sampling_params import SamplingParams

OutputCallback = Callable[[RequestOutput], None]


class EngineDriver(Protocol):
    dead: bool  # a fatal fault: no more requests are taken (submit raises EngineDeadError)
    max_model_len: int

    def start(self) -> None:
        """Start taking requests and delivering their outputs."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               request_id: str | None = None) -> str:
        """Validate now (raises ValidationError or EngineDeadError), then run; every output of the
        request goes to `on_output` (on another thread), the last with `finished` set."""

    def abort(self, request_id: str) -> None:
        """Stop a request: its blocks are freed and its final output delivered."""

    def stats(self) -> EngineStats:
        """The engine's counters, as of its last step or report."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every request still running (each gets its final output) and stop."""
