"""What the engine's step drives: one interface for every way of running the target."""
from __future__ import annotations

from typing import Protocol

import torch

from backend.model.model_runner import StepInput


class Executor(Protocol):
    """What the engine's step drives, one interface for every way of running the target: a
    ModelRunner here (local), or rank 0's runner with the other ranks behind it
    (backend/parallel/worker_group.py: TensorParallelExecutor, PipelineExecutor)."""
    graph_replays: int

    def launch(self, step: StepInput) -> None:
        """Start a step's forward (its kernels queue on the device, or its first stage runs)."""

    def collect(self) -> torch.Tensor:
        """The logits [sum(num_logits), vocab] float32 of the oldest step launched and not collected."""

    def capture_graphs(self, max_batch_size: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """Capture CUDA graphs of uniform steps (every rank of a tensor-parallel stage does the same)."""

    def compile_decode(self) -> None:
        """Compile decode steps (torch.compile, CPU)."""

    def compile_prefill(self) -> None:
        """Compile prompt and verification steps (torch.compile, CPU)."""
