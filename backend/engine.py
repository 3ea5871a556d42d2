"""The engine: requests in, token/text deltas out, one iteration per `step()`.

One pipeline for every step: schedule (with room for draft tokens) -> propose drafts -> one
forward over the flat batch -> the sampler, on the device (sampling and verification alike) ->
one asynchronous copy of the tokens to the host -> append, detokenize, output.

Overlapped steps (CUDA, no speculation): the GPU never waits for the host. `step()` schedules and
launches step N+1 and only then reads back step N's tokens, whose GPU work finished while the host
was busy with N+1; N+1 is sampled after that read-back, so its penalties and min_tokens see N's
tokens. Step N+1 is scheduled as if every request of step N goes on: its input token is N's sampled
token, copied on the device; a request that N finished (EOS, stop string) wastes one row of N+1,
which is dropped; one that N takes to max_tokens is not scheduled again. Outputs come one step later.

Pipeline parallelism: `step()` launches a batch into the pipeline and returns at once while fewer
than `max_batches_in_flight` are in it; otherwise it waits for the oldest batch's logits and
samples them. The batches hold different requests (the scheduler skips the ones in flight), so
every stage has work while the others do.

Not thread-safe: backend.engine_loop.EngineLoop drives it from one thread.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, GenerationConfig

from backend.attention import make_attention_backend
from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.device import bind_device, resolve_device
from backend.errors import INTERNAL_ERROR, ValidationError
from backend.fault_injection import FaultHook
from backend.host_copy import HostCopy
from backend.host_waits import HostWaits
from backend.host_memory import retain_freed_memory
from backend.linear_tuner import tune_small_batch_linears
from backend.model_loader import TORCH_DTYPES, load_draft_model, load_hf_config, load_model
from backend.model_runner import ModelRunner, StepInput, kv_cache_bytes_per_block
from backend.output_processor import OutputProcessor
from backend.outputs import RequestOutput
from backend.request import Request, RequestStatus
from backend.request_limits import RequestLimits
from backend.draft_proposer import DraftProposer
from backend.ngram_proposer import NgramProposer
from backend.proposer import PendingTokens, Proposer
from backend.sampler import PLACEHOLDER_TOKEN, Logprobs, Sampler
from backend.sampling_metadata import SamplingMetadata, build_sampling_metadata
from backend.speculator import SpecStep, Speculator
from backend.pipeline_parallel import pipeline_stage
from backend.worker_group import PipelineRunner, TensorParallelRunner, WorkerGroup
from backend.sampling_params import SamplingParams
from backend.scheduler import ScheduledBatch, Scheduler
from backend.uploads import on_device

@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    prefix_cache_hit_tokens_total: int
    prefix_cache_query_tokens_total: int
    spec_draft_tokens_total: int
    spec_accepted_tokens_total: int
    spec_accepted_per_position: list[int]  # draft position i -> tokens accepted there
    graph_replays_total: int = 0  # steps (target and draft forwards) that replayed a CUDA graph
    host_waits_total: int = 0  # waits of the host for the device (host_waits.py)


@dataclass(slots=True)
class InFlightStep:
    """A sampled step on its way to the host: its requests and their rows (`meta`), its tokens
    as the next overlapped step reads them (`pending`, on the device) and their host copy."""
    meta: SamplingMetadata
    pending: PendingTokens | None
    host: HostCopy  # the tokens [B, max_k + 1], then the logprobs' tensors when asked for
    spec: SpecStep | None = None  # speculation's measurements of the step, fed once it is back


def pending_tokens(meta: SamplingMetadata, token_ids: torch.Tensor, last_known: list[int]) -> PendingTokens:
    """What the next step needs of this one's tokens before they reach the host.
    token_ids: [B, max_k + 1], PLACEHOLDER_TOKEN past each request's last; last_known: per
    request, its last token on the host (the input of its first row)."""
    num_accepted = (token_ids != PLACEHOLDER_TOKEN).sum(1) - 1  # [B]
    last = token_ids.gather(1, num_accepted[:, None])[:, 0]
    before = token_ids.gather(1, (num_accepted - 1).clamp_min(0)[:, None])[:, 0]
    known = on_device(last_known, token_ids.device, torch.int64)
    previous = torch.where(num_accepted > 0, before, known)
    row_of = {r.request_id: i for i, r in enumerate(meta.requests)}
    return PendingTokens(row_of, meta.num_drafts, previous, last, num_accepted - meta.num_drafts_t)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
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
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(config, name) > 1 and self.device.type != "cpu":  # the ranks would need NCCL and a device each
                raise ValidationError(name, "above 1 runs on CPUs (gloo) only so far")
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.workers = WorkerGroup(config)
        try:
            rank = self.workers.tensor_parallel if self.workers is not None else None
            model, _ = load_model(config.model, config.dtype, self.device, self.max_model_len, rank, stage)
            self.model = model
            self._build(config, model, hf_config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model, hf_config) -> None:
        self.eos_token_ids = self._eos_token_ids(config.model)
        self.vocab_size = model.args.vocab_size
        self.attention = make_attention_backend(config.attention_backend, self.device)
        self.draft_model = None
        if config.speculative_method == "draft":
            self.draft_model = load_draft_model(
                config.draft_model, model, self.tokenizer, config.draft_dtype, self.device, self.max_model_len
            )
        self.linear_choices: dict[str, dict] = {}  # model -> weight shape -> small-batch kernel choice
        for name, m in (("target", model), ("draft", self.draft_model)):
            if m is None:
                continue
            m.use_triton_kernels(self.attention.name == "triton")  # RMSNorm and SiLU-multiply too
            if self.attention.name == "triton" and self.device.type == "cuda":
                self.linear_choices[name] = tune_small_batch_linears(m)
        bytes_per_block = kv_cache_bytes_per_block(model, config.block_size, self.dtype)
        if self.draft_model is not None:
            bytes_per_block += kv_cache_bytes_per_block(self.draft_model, config.block_size, self.draft_dtype)
        self.num_blocks = config.num_kv_blocks or self._num_blocks_for_budget(bytes_per_block)
        if self.num_blocks < 2:
            raise ValidationError("kv_cache_memory_bytes", f"room for {self.num_blocks} KV blocks; need >= 2")
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, self.num_blocks)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.host_waits = HostWaits()  # every wait of the host for the device, per step
        self.runner = ModelRunner(model, self.attention, self.num_blocks, config.block_size, self.device, self.dtype,
                                  self.host_waits)
        if self.workers is not None:  # every rank's KV pool has the same blocks, of its own layers and heads
            self.workers.setup(self.num_blocks, self.vocab_size)
            pipelined = config.pipeline_parallel_size > 1
            self.runner = (PipelineRunner if pipelined else TensorParallelRunner)(self.runner, self.workers)
        # pipeline parallelism: the batches launched and not sampled yet, with their draft distributions
        self.batches_in_flight: collections.deque[tuple[ScheduledBatch, dict]] = collections.deque()
        self.sampler = Sampler(config.seed)
        proposer: Proposer | None = None
        if self.draft_model is not None:
            draft_runner = ModelRunner(
                self.draft_model, self.attention, self.num_blocks, config.block_size, self.device, self.draft_dtype,
                self.host_waits,
            )
            proposer = DraftProposer(draft_runner, self.sampler, self.vocab_size)
        elif config.speculative_method == "ngram":
            proposer = NgramProposer()
        # overlapped steps: on CUDA by default, without speculation (speculation with them is not yet
        # measured on a GPU); asked for, with either. Adaptive k times each step
        # on the device's clock and reads it after the read-back, so it works with overlapped
        # steps; under pipeline parallelism (a step's forward spans the stages) k is fixed
        self.overlap = config.async_scheduling if config.async_scheduling is not None else (
            self.device.type == "cuda" and proposer is None and config.pipeline_parallel_size == 1)
        adaptive = config.adaptive_speculation and config.pipeline_parallel_size == 1
        self.speculator = Speculator(proposer, config.num_speculative_tokens, adaptive, self.device,
                                     draft_budget=config.max_num_batched_tokens)
        self.in_flight: InFlightStep | None = None  # overlapped steps: the one launched last
        self.launched: set[str] = set()  # request ids of the step launched last
        if self.device.type == "cuda" and not config.enforce_eager and self.attention.supports_cuda_graphs \
                and self.workers is None:  # parallel steps run eagerly for now
            # the target: decode steps, and verifications of num_speculative_tokens drafts each;
            # the draft: its one-token forwards, and its first after a verification (2 tokens)
            verify = (config.num_speculative_tokens + 1,) if proposer is not None else ()
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len, (1, *verify))
            if proposer is not None and proposer.runner is not None:
                proposer.runner.capture_graphs(config.max_num_seqs, self.max_model_len, (1, 2))
        self.requests: dict[str, Request] = {}  # request id -> everything about it, until its last output
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.block_manager, self.requests,
                                                self.max_model_len)
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.peak_blocks_used = 0

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

    # -- set-up ---------------------------------------------------------------------------------
    def _eos_token_ids(self, model_dir: str) -> frozenset[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def _num_blocks_for_budget(self, bytes_per_block: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
        else:
            budget = self.config.kv_cache_memory_bytes
        return max(budget // bytes_per_block, 0)

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(prompt_ids, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        request = Request(request_id, list(prompt_ids), params, eos_token_ids=self.eos_token_ids)
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
        self.in_flight = None
        for request in list(self.requests.values()):
            request.num_pending_tokens = 0
            request.error = message
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(self.output_processor.output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.batches_in_flight)

    # -- one iteration ----------------------------------------------------------------------------
    @torch.inference_mode()  # sampling changes the forward's logits in place
    def step(self) -> list[RequestOutput]:
        if isinstance(self.runner, PipelineRunner):
            return self._pipeline_step()
        spec = self.speculator.begin_step()  # None without speculation
        batch, draft_probs = self._schedule()
        self.launched = {r.request_id for r in batch.requests}
        forward_started = spec.timer.mark() if spec is not None else None
        logits = self.runner.run(self.step_input(batch, self.in_flight)) if batch.requests else None
        lookahead = [r.spec.num_lookahead_tokens for r in batch.requests]  # _sample clears them
        if logits is not None and spec is not None:  # adaptive k times the target's forwards
            self.speculator.observe_forward(spec, batch, lookahead, forward_started)
        outputs = self._read_back()  # the step launched before this one (overlapped steps)
        if logits is not None:
            self.in_flight = self._sample(batch, logits, draft_probs)
            if spec is not None and self.in_flight is not None:
                self.speculator.end_step(spec, batch, lookahead)
                self.in_flight.spec = spec
        if not self.overlap:
            outputs += self._read_back()
        self.host_waits.end_step()
        return outputs

    def _pipeline_step(self) -> list[RequestOutput]:
        """Launch a batch of requests not in flight (at most max_num_seqs / max_batches_in_flight
        of them, with their drafts); once `max_batches_in_flight` batches are in flight (or nothing
        new could start), sample (and verify) the oldest batch's logits."""
        busy = {r.request_id for batch, _ in self.batches_in_flight for r in batch.requests}
        in_flight = self.config.max_batches_in_flight
        batch, draft_probs = self._schedule(busy, max_requests=-(-self.config.max_num_seqs // in_flight))
        if batch.requests:
            self.runner.launch(self.step_input(batch))
            self.batches_in_flight.append((batch, draft_probs))
        full = len(self.batches_in_flight) >= in_flight
        if not self.batches_in_flight or (batch.requests and not full):
            return []
        logits = self.runner.collect()
        batch, draft_probs = self.batches_in_flight.popleft()
        self.in_flight = self._sample(batch, logits, draft_probs)
        outputs = self._read_back()
        self.host_waits.end_step()
        return outputs

    def _schedule(self, busy: set[str] = frozenset(), max_requests: int | None = None
                  ) -> tuple[ScheduledBatch, dict[str, torch.Tensor]]:
        """Choose k per request and reserve room for its drafts, schedule, then propose the
        drafts the budget granted. Returns the batch and the draft distributions by request id.
        `busy`: requests in a pipeline batch still in flight, left alone."""
        idle = [r for r in self.scheduler.running if r.request_id not in busy]
        self.speculator.reserve(idle, self.max_model_len)
        batch = self.scheduler.schedule(busy, max_requests)
        for request in batch.preempted:  # its draft KV went with its blocks
            request.spec.drop_drafts()
        if not batch.requests:
            return batch, {}
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - self.block_manager.num_free_blocks)
        pending = self.in_flight.pending if self.in_flight is not None else None
        return batch, self.speculator.propose(batch, idle, pending)

    @staticmethod
    def step_input(batch: ScheduledBatch, in_flight: InFlightStep | None = None) -> StepInput:
        """The target's step. A request whose last step is still on the device (overlapped steps)
        reads that step's last token from there, at positions the device corrects when drafts were
        rejected; draft tokens the host does not hold yet come from the device too."""
        step = StepInput([], [], [], [])
        pending = in_flight.pending if in_flight is not None else None
        row_of = pending.row_of if pending is not None else {}
        sources = [pending.last] if pending is not None else []  # cat() of these feeds from_device
        num_sources = len(row_of)
        for request, n in zip(batch.requests, batch.num_scheduled_tokens):
            start = request.num_computed_tokens
            spec = request.spec
            k = spec.num_lookahead_tokens
            on_device = request.num_pending_tokens > 0  # its last input was sampled last step
            known = request.num_tokens + request.num_pending_tokens  # tokens once the device's land
            num_logits = start + n - known + 1 if start + n >= known else 0
            if not on_device and spec.draft_token_ids is not None:
                step.add(request.tokens_slice(start, start + n), start, request.block_table, num_logits)
                continue
            tokens = [0] if on_device else request.tokens_slice(start, start + n - k)
            at, device = ([0], [row_of[request.request_id]]) if on_device else ([], [])  # token index -> source
            if spec.draft_token_ids is not None:
                tokens += spec.draft_token_ids[:k]
            else:  # drafted from tokens still on the device: the drafts are there too
                at += range(len(tokens), len(tokens) + k)
                tokens += [0] * k
                sources.append(spec.proposal.device_token_ids[:k])
                device += range(num_sources, num_sources + k)
                num_sources += k
            step.add(tokens, start, request.block_table, num_logits)
            step.take_from_device(device, at)
        if step.from_device:
            step.device_tokens = torch.cat(sources)
        if row_of and any(pending.num_drafts):  # without drafts last step, every offset is 0
            step.position_offsets = pending.offsets_for([r.request_id for r in batch.requests])
        return step

    def _sample(
        self, batch: ScheduledBatch, logits: torch.Tensor, draft_probs: dict[str, torch.Tensor]
    ) -> InFlightStep | None:
        """Advance the computed tokens, then sample (and verify drafts) on the device for every
        request whose logits this step computed; the tokens start on their way to the host. None
        when the step only read prompt chunks."""
        sampled: list[Request] = []
        for request, n in zip(batch.requests, batch.num_scheduled_tokens):
            if request.num_computed_tokens + n >= request.num_tokens_with_spec:
                sampled.append(request)
            request.num_computed_tokens += n
            request.spec.num_lookahead_tokens = 0
        if not sampled:
            return None
        for r in sampled:  # drafts proposed from tokens then on the device: their copy has landed
            if r.spec.draft_token_ids is None:
                r.spec.draft_token_ids = r.spec.proposal.host_token_ids()
        drafts = [r.spec.draft_token_ids for r in sampled]
        meta = build_sampling_metadata(sampled, drafts, self.vocab_size, self.sampler.generator, self.device)
        q = None  # [D, vocab] the draft model's distributions; None: one-hot drafts (n-gram, greedy)
        per_request = [draft_probs.get(r.request_id) for r in sampled]
        if any(p is not None for p in per_request):  # a greedy request has none: zero rows, never read
            q = torch.cat([p if p is not None else logits.new_zeros(len(d), logits.shape[1])
                           for p, d in zip(per_request, drafts)])
        last_known = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in sampled] \
            if self.overlap else []
        for request, d in zip(sampled, drafts):
            request.num_pending_tokens += len(d) + 1  # as if every draft is accepted
            request.spec.draft_token_ids, request.spec.proposal = [], None
        output = self.sampler(logits, meta, q)
        # what the next step reads before the tokens reach the host (overlapped steps only)
        pending = pending_tokens(meta, output.token_ids, last_known) if self.overlap else None
        logprobs = output.logprobs.tensors() if output.logprobs is not None else ()
        return InFlightStep(meta, pending, HostCopy(output.token_ids, *logprobs, waits=self.host_waits))

    def _read_back(self) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens, then append them to their requests (those still
        alive: a request aborted or finished since wasted its row), roll back rejected draft
        positions, and return the requests' outputs."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
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
            request.num_pending_tokens -= k + 1
            error = step.meta.errors.get(request.request_id)
            new = [t for t in row_tokens if t != PLACEHOLDER_TOKEN] if error is None else []
            if k and error is None:
                num_accepted = len(new) - 1
                self.speculator.record(request, k, num_accepted)
                if request.status is RequestStatus.RUNNING:  # (preempted: recomputed from 0)
                    self._roll_back(request, k - num_accepted)
            entries = [self.output_processor.logprob_entry(logprobs.get(row), token, request.params.logprobs)
                       for row, token in zip(rows, new)]
            # trim: no block stays for rejected positions, unless the step launched since holds them
            trim = k > 0 and not (self.overlap and request.request_id in self.launched)
            outputs.append(self.output_processor.advance(request, new, entries, error, trim=trim))
        if step.spec is not None:
            self.speculator.finish_step(step.spec, sum(len(o.token_ids) for o in outputs))
        return outputs

    @staticmethod
    def _roll_back(request: Request, num_rejected: int) -> None:
        """Its computed counts assumed every draft accepted: take the rejected positions off (and
        off the draft's, when it drafted ahead from those positions before they were known)."""
        request.num_computed_tokens -= num_rejected
        if request.spec.drafted_ahead:
            request.spec.num_computed_tokens -= num_rejected
        else:
            request.spec.num_computed_tokens = min(request.spec.num_computed_tokens, request.num_computed_tokens)

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
