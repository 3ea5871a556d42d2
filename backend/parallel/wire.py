"""How what crosses a process or host boundary is encoded, besides tensors: msgpack (msgspec),
decoded on receipt into the one type its receiver expects, so a message that is not one is
refused (WireError) and nothing in it is ever run.

    a step between ranks    StepHeader (None: stop): a StepInput's host lists; its tensors follow
                            it as tensors (backend/parallel/distributed.py)
    engine-core channel     its messages (backend/process/core_messages.py)

Dataclasses inside a message decode into themselves, their __post_init__ checks included. The
engine's config travels as JSON (EngineConfig.to_json / from_json).
"""
from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import torch

from backend.model.model_runner import StepInput

T = TypeVar("T")


class WireError(ValueError):
    """A message that does not decode into what its receiver expects."""


class StepHeader(msgspec.Struct, frozen=True, array_like=True):
    """A StepInput without its tensors, which follow it (int64, on the ranks' devices: the tensors'
    plane, backend/parallel/distributed.py): device_tokens [num_device_tokens], then
    position_offsets [num_requests] if it has them."""
    token_ids: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    num_logits: list[int]
    from_device: list[tuple[int, int]]
    num_device_tokens: int | None  # None: no device_tokens
    has_position_offsets: bool
    block_copies: list[tuple[int, int, int]]  # (source block, destination block, tokens)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not n == len(self.start_positions) == len(self.block_tables) == len(self.num_logits):
            raise ValueError("token_ids, start_positions, block_tables and num_logits differ in length")
        if self.num_device_tokens is not None and self.num_device_tokens < 0:
            raise ValueError(f"num_device_tokens must be >= 0, got {self.num_device_tokens}")
        if any(source < 0 or destination < 0 or n < 1 for source, destination, n in self.block_copies):
            raise ValueError("block_copies must hold block ids >= 0 and token counts >= 1")

    @classmethod
    def of(cls, step: StepInput, device: torch.device) -> tuple[StepHeader, tuple[torch.Tensor, ...]]:
        """The step's header and the tensors that follow it, on `device` (the sender's)."""
        tensors = tuple(t.reshape(-1).to(device, torch.int64) for t in (step.device_tokens, step.position_offsets)
                        if t is not None)
        device_tokens = None if step.device_tokens is None else step.device_tokens.numel()
        return cls(step.token_ids, step.start_positions, step.block_tables, step.num_logits, step.from_device,
                   device_tokens, step.position_offsets is not None, step.block_copies), tensors

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Where to receive the tensors that follow this header, on `device` (the receiver's)."""
        sizes = [self.num_device_tokens] if self.num_device_tokens is not None else []
        sizes += [len(self.token_ids)] if self.has_position_offsets else []
        return tuple(torch.empty(n, dtype=torch.int64, device=device) for n in sizes)

    def step(self, tensors: tuple[torch.Tensor, ...]) -> StepInput:
        """The StepInput again, with its tensors (as `buffers` made them, now filled)."""
        received = iter(tensors)
        device_tokens = next(received) if self.num_device_tokens is not None else None
        position_offsets = next(received) if self.has_position_offsets else None
        return StepInput(self.token_ids, self.start_positions, self.block_tables, self.num_logits, device_tokens,
                         self.from_device, position_offsets, self.block_copies)


class Decoder(Generic[T]):
    """Bytes -> a T, or WireError naming what was expected and why the bytes are not one."""

    def __init__(self, kind: object, name: str):
        self.decoder = msgspec.msgpack.Decoder(kind)
        self.name = name

    def decode(self, data: bytes) -> T:
        try:
            return self.decoder.decode(data)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            raise WireError(f"not {self.name}: {e}") from None


_encoder = msgspec.msgpack.Encoder()
STEPS: Decoder[StepHeader | None] = Decoder(StepHeader | None, "a step")


def encode(message: object) -> bytes:
    return _encoder.encode(message)
