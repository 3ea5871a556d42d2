"""Times spans of one step on the device's own clock, read only after the step's tokens are back.

On CUDA a mark is an event recorded on the stream (no wait); the spans between marks are read once
the step's read-back has waited for its tokens, by which time every mark before them has passed.
On a CPU a mark is `time.perf_counter()`. Speculation's cost model is fed this way, so timing a
step costs no wait of its own and works the same whether steps overlap or not.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

Mark = torch.cuda.Event | float


@dataclass(slots=True)
class Span:
    kind: str  # "draft", "target" or "step"
    sizes: tuple[int, ...]  # what the span computed (tokens, requests: see its user)
    start: Mark
    end: Mark


@dataclass(slots=True)
class StepTimer:
    on_cuda: bool
    spans: list[Span] = field(default_factory=list)

    @classmethod
    def for_device(cls, device: torch.device) -> StepTimer:
        return cls(device.type == "cuda")

    def mark(self) -> Mark:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, kind: str, sizes: tuple[int, ...], start: Mark) -> None:
        """A span from `start` to now."""
        self.spans.append(Span(kind, sizes, start, self.mark()))

    @staticmethod
    def seconds(span: Span) -> float:
        """Only once the step's read-back has waited (CUDA: both events have passed)."""
        if isinstance(span.start, float):
            return span.end - span.start
        return span.start.elapsed_time(span.end) / 1000.0
