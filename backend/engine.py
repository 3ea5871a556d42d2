"""The engine: requests in, token/text deltas out, one iteration per `step()`.

Every step goes one way, over a queue of steps in flight (`in_flight`, oldest first):

    batch = schedule()                        # one token budget; room for drafts; drafts proposed
    launch(batch)                             # its forward, pushed onto the queue
    if the queue holds `depth` steps, or nothing was launched:
        read_back(sample(oldest))             # sample and verify on the device, one read-back,
                                              # then append, stop, detokenize (output_processor.py)

`depth` is the one number that differs: 1 is plain decoding (each step is read back at once); 2
overlapped steps (CUDA, by default without speculation): step N+1 is scheduled and launched
before N's tokens are read back, reading N's sampled tokens on the device (step_inputs.py), and
is sampled once N is back, so its penalties and min_tokens see N's tokens; a request that N
finished (EOS, stop string) wastes one row of N+1, which is dropped; one that N takes to
max_tokens is not scheduled again; outputs come one step later. Pipeline parallelism keeps
`max_batches_in_flight` batches in the pipeline: they hold different requests (a request whose
step is launched and not sampled yet is not scheduled again), so every stage has work while the
others do, and a batch is sampled when its logits come back from the last stage.

Not thread-safe: backend.engine_loop.EngineLoop drives it from one thread.
"""
from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.core.block_manager import BlockManager
from backend.core.detokenizer import IncrementalDetokenizer
from backend.core.fault_injection import FaultHook
from backend.core.grammar_compiler import GrammarCompiler
from backend.core.guide import Guide
from backend.core.output_processor import OutputProcessor
from backend.core.request import Request, RequestStatus
from backend.core.request_limits import RequestLimits
from backend.core.scheduler import ScheduledBatch, Scheduler
from backend.device import bind_device, check_gpus, device_of_rank
from backend.errors import INTERNAL_ERROR, ValidationError
from backend.host_copy import HostCopy
from backend.host_memory import retain_freed_memory
from backend.engine_setup import (
    choose_linear_kernels, eos_token_ids, load_draft, make_proposer, prepare_steps, size_kv_pool,
)
from backend.host_waits import HostWaits
from backend.model.attention import make_attention_backend
from backend.model.model_loader import TORCH_DTYPES, load_hf_config, load_model
from backend.model.executor import Executor
from backend.model.model_runner import ModelRunner
from backend.model.pipeline_parallel import pipeline_stage
from backend.model.step_inputs import PendingTokens, target_input
from backend.outputs import EngineStats, RequestOutput
from backend.parallel.worker_group import PipelineExecutor, TensorParallelExecutor, WorkerGroup
from backend.sample.sampler import PLACEHOLDER_TOKEN, Logprobs, Sampler
from backend.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from backend.sampling_params import SamplingParams
from backend.speculative.speculator import SpecStep, Speculator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    """A step between its launch and its read-back: its forward launched, then sampled on the
    device (`meta` set), its tokens on their way to the host."""
    batch: ScheduledBatch
    draft_probs: dict[str, torch.Tensor | None]  # request id -> the distributions its drafts came from
    lookahead: list[int]  # per request of the batch: the draft tokens it verifies
    spec: SpecStep | None  # speculation's measurements of the step, fed once it is back
    sampled: bool = False
    meta: SamplingMetadata | None = None  # its sampled requests and their rows (None: prompt chunks only)
    pending: PendingTokens | None = None  # its tokens as the next overlapped step reads them
    host: HostCopy | None = None  # the tokens [B, max_k + 1], then the logprobs' tensors when asked for


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.device = device_of_rank(config, 0)  # under tensor or pipeline parallelism, rank 0's
        config = self.config = config.for_device(self.device.type)  # its "auto" values chosen
        log.info("on %s: dtype=%r quantization=%r compile_decode=%s compile_prefill=%s", self.device, config.dtype,
                 config.quantization, config.compile_decode, config.compile_prefill)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.draft_dtype = TORCH_DTYPES[config.draft_dtype]
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            retain_freed_memory()
        else:  # kernels and memory queries of the set-up go to this device (the loop's thread binds it too)
            bind_device(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)
        hf_config = load_hf_config(config.model)
        self.max_model_len = config.max_model_len or hf_config.max_position_embeddings
        if self.max_model_len > hf_config.max_position_embeddings:
            raise ValidationError(
                "max_model_len",
                f"must be <= the model's max_position_embeddings ({hf_config.max_position_embeddings})",
            )
        self.workers: WorkerGroup | None = None  # the other ranks, under tensor or pipeline parallelism
        stage = None  # rank 0's pipeline stage, the first
        if config.pipeline_parallel_size > 1:
            try:
                stage = pipeline_stage(hf_config.num_hidden_layers, 0, config.pipeline_parallel_size,
                                       config.pipeline_layer_partition)
            except ValueError as e:
                name = "pipeline_layer_partition" if config.pipeline_layer_partition else "pipeline_parallel_size"
                raise ValidationError(name, str(e)) from None
        if self.device.type == "cuda":
            check_gpus(config)  # a GPU for each of this node's ranks
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.workers = WorkerGroup(config)
        try:
            rank = self.workers.tensor_parallel if self.workers is not None else None
            model, _ = load_model(config.model, config.dtype, self.device, self.max_model_len, rank, stage,
                                  quantization=config.quantization,
                                  quantization_group_size=config.quantization_group_size)
            self.model = model
            self._build(config, model, hf_config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model, hf_config) -> None:
        """Everything after the target's weights are loaded, stage by stage (engine_setup.py)."""
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.vocab_size = model.args.vocab_size
        self.attention = make_attention_backend(config.attention_backend, self.device)
        self.draft_model = load_draft(config, model, self.tokenizer, self.device, self.max_model_len)
        self.linear_choices = choose_linear_kernels(config, model, self.draft_model, self.attention.name == "triton",
                                                    self.device)
        self.num_blocks = size_kv_pool(config, model, self.draft_model, self.dtype, self.draft_dtype, self.device)
        self._build_scheduling(config)
        self._build_runners(config, model)
        self._build_speculation(config)
        prepare_steps(config, self.runner, self.speculator.proposer, self.device, self.attention, self.max_model_len)
        self.output_processor = OutputProcessor(self.scheduler, self.block_manager, self.requests,
                                                self.max_model_len)
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.peak_blocks_used = 0

    def _build_scheduling(self, config: EngineConfig) -> None:
        """Request limits, constraints, KV blocks and the scheduler."""
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, self.num_blocks,
                                    tuple(sorted(self.eos_token_ids)))
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}  # request id -> everything about it, until its last output

    def _build_runners(self, config: EngineConfig, model) -> None:
        """The target's executor (with the other ranks behind it, if any) and the sampler."""
        self.host_waits = HostWaits()  # every wait of the host for the device, per step
        self.runner: Executor = ModelRunner(model, self.attention, self.num_blocks, config.block_size, self.device,
                                            self.dtype, self.host_waits)
        if self.workers is not None:  # every rank's KV pool has the same blocks, of its own layers and heads
            self.workers.setup(self.num_blocks, self.vocab_size)
            pipelined = config.pipeline_parallel_size > 1
            self.runner = (PipelineExecutor if pipelined else TensorParallelExecutor)(self.runner, self.workers)
        self.sampler = Sampler(config.seed)

    def _build_speculation(self, config: EngineConfig) -> None:
        """The proposer and the speculator; overlapped steps and how many steps are in flight."""
        draft_runner = None
        if self.draft_model is not None:
            draft_runner = ModelRunner(
                self.draft_model, self.attention, self.num_blocks, config.block_size, self.device, self.draft_dtype,
                self.host_waits,
            )
        proposer = make_proposer(config, self.draft_model, draft_runner, self.sampler, self.vocab_size)
        # overlapped steps: on CUDA by default, without speculation (speculation with them is not yet
        # measured on a GPU); asked for, with either. Adaptive k times each step
        # on the device's clock and reads it after the read-back, so it works with overlapped
        # steps; under pipeline parallelism (a step's forward spans the stages) k is fixed
        self.overlap = config.async_scheduling if config.async_scheduling is not None else (
            self.device.type == "cuda" and proposer is None and config.pipeline_parallel_size == 1)
        adaptive = config.adaptive_speculation and config.pipeline_parallel_size == 1
        self.speculator = Speculator(proposer, config.num_speculative_tokens, adaptive, self.device,
                                     draft_budget=config.max_num_batched_tokens, live=self.requests)
        pipelined = config.pipeline_parallel_size > 1
        # steps in flight before the oldest is read back: 1 plain, 2 overlapped, the pipeline's batches
        self.depth = config.max_batches_in_flight if pipelined else 1 + self.overlap
        self.max_requests_per_step = -(-config.max_num_seqs // self.depth) if pipelined else None
        self.in_flight: collections.deque[InFlightStep] = collections.deque()  # launched, not read back; oldest first

    @property
    def fault_hook(self) -> FaultHook | None:
        return self.output_processor.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self.output_processor.fault_hook = hook

    def close(self) -> None:
        """Stop the worker ranks, if any."""
        if self.workers is not None:
            self.workers.close()

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValidationError; compiles a constraint (in the caller's thread, cached for
        add_request)."""
        self.limits.validate(prompt_ids, params, self.grammars)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        request = Request(request_id, list(prompt_ids), params, eos_token_ids=self.eos_token_ids)
        if params.guided_decoding is not None:
            request.guide = Guide(self.grammars.compile(params.guided_decoding))
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.prompt_tokens_total += len(prompt_ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort at once (blocks freed); returns the request's final output, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.output(request)

    def fail_all(self, message: str = INTERNAL_ERROR) -> list[RequestOutput]:
        """End every request with an error (after an exception in a step that no one request
        can be blamed for)."""
        outputs = []
        self.in_flight.clear()
        for request in list(self.requests.values()):
            request.drop_pending()
            request.error = message
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(self.output_processor.output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # -- one iteration ----------------------------------------------------------------------------
    @torch.inference_mode()  # sampling changes the forward's logits in place
    def step(self) -> list[RequestOutput]:
        launched = self._launch()
        outputs = []
        if self.in_flight and (len(self.in_flight) >= self.depth or launched is None):
            outputs = self._read_back(self._sample(self.in_flight.popleft()))
        if self.overlap and self.in_flight:  # the step launched now, its predecessor back: sample it
            self._sample(self.in_flight[0])
        self.host_waits.end_step()
        return outputs

    def _launch(self) -> InFlightStep | None:
        """Schedule (requests whose step is launched and not sampled yet sit out), propose the
        drafts, launch the forward and push the step onto the queue; None when nothing was
        scheduled."""
        spec = self.speculator.begin_step()  # None without speculation
        busy = {r.request_id for s in self.in_flight if not s.sampled for r in s.batch.requests}
        idle = [r for r in self.scheduler.running if r.request_id not in busy]
        self.speculator.reserve(idle, self.max_model_len)
        batch = self.scheduler.schedule(busy, self.max_requests_per_step)
        for request in batch.preempted:  # its draft KV went with its blocks
            request.spec.drop_drafts()
        if not batch.requests:
            return None
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - self.block_manager.num_free_blocks)
        pending = self.in_flight[-1].pending if self.in_flight else None  # tokens the last step left on the device
        draft_probs = self.speculator.propose(batch, idle, pending)
        lookahead = [r.spec.num_lookahead_tokens for r in batch.requests]  # _sample clears them
        forward_started = spec.timer.mark() if spec is not None else None
        target_step = target_input(batch, pending)
        target_step.block_copies = self.block_manager.take_copies(batch.requests)
        self.runner.launch(target_step)
        if spec is not None:  # adaptive k times the target's forwards
            self.speculator.observe_forward(spec, batch, lookahead, forward_started)
        step = InFlightStep(batch, draft_probs, lookahead, spec)
        self.in_flight.append(step)
        return step

    def _sample(self, step: InFlightStep) -> InFlightStep:
        """Advance the computed tokens, then sample (and verify drafts) on the device for every
        request whose logits the step computed; the tokens start on their way to the host."""
        if step.sampled:
            return step
        step.sampled = True
        logits = self.runner.collect()  # [num_logits, vocab]: the oldest launched step's
        batch = step.batch
        sampled: list[Request] = []
        for request, n in zip(batch.requests, batch.num_scheduled_tokens):
            if request.num_computed_tokens + n >= request.num_tokens_with_spec:
                sampled.append(request)
            request.computed(n)
        if not sampled:
            return step
        for r in sampled:  # drafts proposed from tokens then on the device: their copy has landed
            if r.spec.draft_token_ids is None:
                r.spec.draft_token_ids = r.spec.proposal.host_token_ids()
        drafts = [r.spec.draft_token_ids for r in sampled]
        meta = build_sampling_metadata(sampled, drafts, self.vocab_size, self.sampler.generator, self.device)
        q = None  # [D, vocab] the draft model's distributions; None: one-hot drafts (n-gram, greedy)
        per_request = [step.draft_probs.get(r.request_id) for r in sampled]
        if any(p is not None for p in per_request):  # a greedy request has none: zero rows, never read
            q = torch.cat([p if p is not None else logits.new_zeros(len(d), logits.shape[1])
                           for p, d in zip(per_request, drafts)])
        last_known = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in sampled] \
            if self.overlap else []
        for request, d in zip(sampled, drafts):
            request.sampled(len(d))
        output = self.sampler(logits, meta, q)
        if self.overlap:  # what the next step reads before the tokens reach the host
            step.pending = PendingTokens.of_step(meta, output.token_ids, last_known)
        logprobs = output.logprobs.tensors() if output.logprobs is not None else ()
        step.meta, step.host = meta, HostCopy(output.token_ids, *logprobs, waits=self.host_waits)
        if step.spec is not None:
            self.speculator.end_step(step.spec, batch, step.lookahead)
        return step

    def _read_back(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for a sampled step's tokens, then append them to their requests (those still
        alive: a request aborted or finished since wasted its row), roll back rejected draft
        positions, and return the requests' outputs."""
        if step.host is None:
            return []
        still_in_flight = {r.request_id for s in self.in_flight for r in s.batch.requests}
        token_ids, *logprob_tensors = step.host.wait()
        tokens = token_ids.tolist()
        logprobs = Logprobs(step.meta.logprob_rows, *logprob_tensors).entries() if logprob_tensors else {}
        outputs = []
        first_row = 0
        for request, k, row_tokens in zip(step.meta.requests, step.meta.num_drafts, tokens):
            rows = range(first_row, first_row + k + 1)
            first_row += k + 1
            if self.requests.get(request.request_id) is not request:
                continue
            error = step.meta.errors.get(request.request_id)
            new = [t for t in row_tokens if t != PLACEHOLDER_TOKEN] if error is None else []
            num_accepted = len(new) - 1 if error is None else k  # a failed row rolls nothing back
            request.landed(k, num_accepted)
            if k and error is None:
                self.speculator.record(step.spec, request, k, num_accepted)
            entries = [self.output_processor.logprob_entry(logprobs.get(row), token, request.params.logprobs)
                       for row, token in zip(rows, new)]
            # trim: no block stays for rejected positions, unless a step launched since holds them
            trim = k > 0 and request.request_id not in still_in_flight
            outputs.append(self.output_processor.advance(request, new, entries, error, trim=trim))
        if step.spec is not None:
            self.speculator.finish_step(step.spec, sum(len(o.token_ids) for o in outputs))
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens_total=bm.prefix_hit_tokens,
            prefix_cache_query_tokens_total=bm.prefix_query_tokens,
            spec_draft_tokens_total=self.speculator.num_draft_tokens,
            spec_accepted_tokens_total=self.speculator.num_accepted_tokens,
            spec_accepted_per_position=list(self.speculator.accepted_per_position),
            graph_replays_total=self.runner.graph_replays + (
                self.speculator.proposer.runner.graph_replays
                if self.speculator.proposer is not None and self.speculator.proposer.runner is not None else 0),
            host_waits_total=self.host_waits.total,
        )
