"""What the in-process benchmarks share: timing an engine's steps and the parts of a step, greedy
runs of a workload, how far two runs' tokens agree, and the sizes a time is measured against
(memory bandwidth, weight bytes a step reads).
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sample.sampler import Sampler
from backend.sampling_params import SamplingParams
from perf.random_checkpoints import NUM_SPECIAL_TOKENS


# -- timing ----------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(slots=True)
class PartTimer:
    """Wall time and calls per part of an engine's step, gathered by wrapping methods of the
    engine's objects (on the instances only)."""

    device: torch.device | None = None  # synchronized before and after each timed call (CUDA)
    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))

    def timed(self, label: str, fn):
        """`fn` with its calls timed under `label`."""

        def call(*args, **kwargs):
            if self.device is not None:
                sync(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.device is not None:
                    sync(self.device)
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        return call

    def wrap(self, obj, name: str, label: str) -> None:
        """Time every call of obj.<name> under `label` (set on the instance)."""
        object.__setattr__(obj, name, self.timed(label, getattr(obj, name)))


class TimedSampler(Sampler):
    """An engine's sampler whose calls a PartTimer times: put in as `engine.sampler` (the engine
    samples every step's tokens through it), it draws from the engine's own generator."""

    def __init__(self, engine: LLMEngine, timer: PartTimer, label: str):
        super().__init__()
        self.generator = engine.sampler.generator
        self.timed_call = timer.timed(label, super().__call__)

    def __call__(self, logits: torch.Tensor, meta, draft_probs: torch.Tensor | None = None):
        return self.timed_call(logits, meta, draft_probs)


def decode_steps(engine: LLMEngine, steps: int, after_warm_up=lambda: None) -> list[float]:
    """Times of `steps` decode steps of one request, after its prefill and first decode."""
    engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    after_warm_up()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def batch1_step_ms(engine: LLMEngine, prompt: list[int], steps: int) -> float:
    """The median time of a decode step of one request (after its prefill and first decode)."""
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefill_ms(engine: LLMEngine, length: int, repeats: int) -> float:
    """The median time of the step that prefills one request of `length` tokens (prefix caching
    cannot help: each repeat's first token differs)."""
    times = []
    for i in range(repeats + 1):
        prompt = [100 + i] + [(7 * j) % 5000 + 200 for j in range(length - 1)]
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


# -- what a time is measured against ---------------------------------------------------------------
def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a float32 sum streams from memory with torch's threads."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times)


def weight_bytes_per_step(model) -> int:
    """Bytes of weight a decode step reads: every linear layer's weights (and scales) and one
    embedding row per token."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor is not None and tensor.dim() >= 1 and module.__class__.__name__ != "RotaryEmbedding":
                total += tensor.numel() * tensor.element_size()
    return total


# -- workloads and greedy runs ---------------------------------------------------------------------
@dataclass(slots=True)
class Workload:
    """Offline requests as token ids, all added at once (perf/bench_engine.py and the parallel ones)."""

    prompts: list[list[int]]
    max_tokens: list[int]  # same order: tokens each request generates (EOS ignored)

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


def add_model_and_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The random Llama's shape (write_random_llama) and the workload's lengths (make_workload)."""
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4, help="fewer than --heads for GQA")
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=16)


def make_workload(num_requests: int, vocab: int, args: argparse.Namespace, seed: int) -> Workload:
    """Random-token prompts of --min-prompt..--max-prompt tokens, each generating --min-tokens..--max-tokens."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(args.min_tokens, args.max_tokens) for _ in range(num_requests)])


def greedy_run(engine: LLMEngine, workload: Workload) -> tuple[float, list[list[int]]]:
    """Every request of the workload at once, greedy: the wall time and the outputs. Closes the engine."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(workload.prompts, workload.max_tokens)]
    outputs = {i: [] for i in ids}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    wall = time.perf_counter() - started
    engine.close()
    return wall, [outputs[i] for i in ids]


def engine_generate(model_dir: Path, dtype: str, prompts: list[list[int]], max_tokens: int, eos: int,
                    threads: int, batch: int, engine: LLMEngine | None = None) -> tuple[list[list[int]], float]:
    """Greedy answers and tok/s with `batch` requests in flight, from `engine` (else a new one)."""
    engine = engine or LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, num_threads=threads, max_num_seqs=64))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    outputs: dict[str, list[int]] = {}
    order, pending, in_flight, tokens = [], list(prompts), 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < batch:
            order.append(engine.add_request(pending.pop(0), params))
            in_flight += 1
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            tokens += len(out.token_ids)
            in_flight -= out.finished
    wall = time.perf_counter() - start
    return [strip_eos(outputs.get(r, []), eos) for r in order], tokens / wall


def strip_eos(ids: list[int], eos: int) -> list[int]:
    """`ids` without a final `eos`."""
    return ids[:-1] if ids and ids[-1] == eos else ids


# -- agreement -------------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def teacher_forced_agreement(model, prompts: list[list[int]], references: list[list[int]]) -> float:
    """Share of positions of the reference continuations where `model`'s argmax is the reference token."""
    agree = total = 0
    for prompt, ref in zip(prompts, references):
        if not ref:
            continue
        logits = model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1:-1]  # [len(ref), vocab]
        agree += (logits.argmax(-1) == torch.tensor(ref)).sum().item()
        total += len(ref)
    return agree / total
