"""What the GPU path must do, checked on the CPU: the host's waits per step (counted on every
device), no wait for the whole device queue on the step path, adaptive k with overlapped steps,
the engine's thread binding its device, which steps a CUDA graph replays (overlapped decode and
verification steps among them), and that what a graph replays computes what the eager step does."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from backend import engine_setup
from backend import engine_loop
from backend.model.attention import TorchAttention, TritonAttention
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.model.model_loader import load_model
from backend.model.model_runner import GRAPH_BATCH_SIZES, ModelRunner, StepInput, graph_shape
from backend.sampling_params import SamplingParams

BACKEND = Path(__file__).resolve().parents[2] / "backend"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class StaticForward:
    """A captured graph's stand-in on a CPU: its replay runs the forward the graph captured (from
    the static inputs) into the graph's logits."""

    def __init__(self, runner: ModelRunner, b: int, q: int):
        self.runner, self.b, self.q = runner, b, q

    def replay(self) -> None:
        self.runner.graph_io[f"logits_{self.b}_{self.q}"] = self.runner.graph_forward_static(self.b, self.q)


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Engines made in the test take the CUDA step path: the graphs CUDA would capture (each a
    StaticForward), their inputs staged and uploaded each step, the waits that costs counted."""
    cuda_query_lens = engine_setup.target_graph_query_lens  # what it answers on CUDA with Triton attention
    monkeypatch.setattr(engine_setup, "target_graph_query_lens",
                        lambda config, *_: cuda_query_lens(config, torch.device("cuda", 0), TritonAttention()))
    monkeypatch.setattr(ModelRunner, "capture_graph", lambda runner, b, q, pool: (StaticForward(runner, b, q), None, None))


def _decode(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[int]:
    """Run the requests to the end; the host waits of each step."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return list(engine.host_waits.per_step)[-steps:]


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_decoding_waits_once_per_step(tiny_llama, graphs_on_cpu, overlap):
    """Overlapped: the first step (a prefill, sampled) reads nothing back; every later one reads
    the step before it, once. Plain: every step reads its own tokens, once. Decode steps replay
    graphs, whose staged inputs cost no wait of their own (before, on CUDA, every step waited
    for the last upload too: 2 waits a step)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), async_scheduling=overlap))
    waits = _decode(engine, [[5, 6, 7, 8], [9, 10, 11]])
    assert waits == ([0] if overlap else [1]) + [1] * (len(waits) - 1)
    assert len(waits) == 12 + overlap  # overlapped: the last tokens are read back one step later
    assert engine.stats().graph_replays_total == 11  # every step after the prefill


def test_speculation_with_overlapped_steps_waits_at_most_twice_per_step(tiny_llama, graphs_on_cpu):
    """The read-back of the step before, and the host copy of drafts proposed from its tokens
    while they were still on the device: never once per draft forward (before, on CUDA, each
    draft forward waited for the upload of the one before it: 6 waits a step at k = 3)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="draft", draft_model=str(tiny_llama),
                                    num_speculative_tokens=3, adaptive_speculation=False, async_scheduling=True))
    waits = _decode(engine, [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                       ignore_eos=True))
    assert max(waits) == 2 and waits.count(2) >= 3
    assert engine.stats().spec_draft_tokens_total > 0
    # verifications and draft forwards replayed graphs, each of their inputs staged and uploaded
    assert engine.runner.graph_replays >= 5 and engine.speculator.proposer.runner.graph_replays >= 3 * 5


def test_nothing_on_the_step_path_waits_for_the_whole_device():
    """torch.cuda.synchronize only where graphs are captured at start-up (and the start-up tuner);
    every other wait is for one event, through host_waits.py. Checked in the source: a CPU run
    never reaches a CUDA-only branch."""
    allowed = {"model_runner.py": 2, "linear_tuner.py": 1}  # capture_decode_graphs; tune_small_batch_linears
    for path in sorted(BACKEND.rglob("*.py")):
        found = len(re.findall(r"\bsynchronize\(", path.read_text()))
        if path.name == "host_waits.py":
            assert found == 1  # event.synchronize() in HostWaits.wait: the one place that waits
        else:
            assert found == allowed.get(path.name, 0), path.name


def test_adaptive_k_changes_k_with_overlapped_steps(tiny_llama, bad_draft):
    """A draft that is always rejected: adaptive k, fed after each read-back, lowers k (or turns
    speculation off), where before overlapped steps kept k fixed at num_speculative_tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="draft", draft_model=str(bad_draft),
                                    num_speculative_tokens=4, async_scheduling=True))
    control = engine.speculator.control
    assert engine.overlap and control.adaptive
    plan, ks = control.plan, []

    def recorded_plan(candidates, num_running):
        planned = plan(candidates, num_running)
        ks.extend(planned[0])
        return planned

    control.plan = recorded_plan
    _decode(engine, [[5 + i, 6, 7, 8] for i in range(4)], SamplingParams(max_tokens=60, temperature=0.0,
                                                                        ignore_eos=True))
    assert 0 < ks[0] and ks[-1] == 0  # k came down (fixed, it would stay 4) ...
    assert control.target_cost.ready  # ... from costs measured after read-backs


def test_the_engine_thread_binds_its_device(tiny_llama, monkeypatch):
    """CUDA's current device is per thread: the loop's own thread binds the engine's device before
    its first step (an instance on cuda:N would otherwise launch on GPU 0)."""
    bound = []
    monkeypatch.setattr(engine_loop, "bind_device", lambda device: bound.append((device, threading.current_thread().name)))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    loop = EngineLoop(engine)
    done = threading.Event()
    loop.start()
    loop.submit([5, 6, 7], GREEDY, lambda out: out.finished and done.set())
    assert done.wait(60)
    loop.shutdown()
    assert bound == [(engine.device, "specserve-engine")]


def test_graph_shape_takes_uniform_steps_only():
    sizes = {1: (1, 2, 4, 8), 4: (1, 2, 4, 8)}

    def step(tokens_per_request, num_logits=None, offsets=None):
        n = len(tokens_per_request)
        return StepInput([[0] * q for q in tokens_per_request], [5] * n, [[1]] * n,
                         num_logits or list(tokens_per_request), position_offsets=offsets)

    assert graph_shape(step([1, 1, 1]), sizes) == (4, 1)  # decode, padded to the bucket
    assert graph_shape(step([1] * 3, offsets=torch.zeros(3)), sizes) == (4, 1)  # overlapped
    assert graph_shape(step([4] * 5), sizes) == (8, 4)  # verification of 3 drafts each
    assert graph_shape(step([1, 4]), sizes) is None  # mixed
    assert graph_shape(step([3, 3]), sizes) is None  # a k that was not captured
    assert graph_shape(step([4, 4], num_logits=[1, 1]), sizes) == (2, 4)  # the last token's logits
    assert graph_shape(step([4, 4], num_logits=[2, 2]), sizes) is None
    assert graph_shape(step([1] * 9), sizes) is None  # past the biggest bucket
    assert graph_shape(step([4] * 3), {1: (1, 2, 4, 8), 4: (1, 2)}) is None  # no verification graph that big


@pytest.mark.parametrize("q,num_logits,offsets", [(1, 1, None), (1, 1, [0, -2, 0]), (4, 4, None), (4, 4, [-3, 0, -1]),
                                                  (2, 1, [-1, 0, -2])])
def test_what_a_graph_replays_computes_the_eager_step(tiny_llama, q, num_logits, offsets):
    """The forward a graph captures (from its static inputs, offsets applied on the device) gives
    the eager step's logits and writes its K/V to the same slots; padding rows write nowhere."""
    model, _ = load_model(tiny_llama, "float32", torch.device("cpu"), 256)

    def runner():
        r = ModelRunner(model, TorchAttention(), num_blocks=32, block_size=8, device=torch.device("cpu"),
                        dtype=torch.float32)
        torch.manual_seed(0)
        for k, v in r.kv_caches:  # a context already cached
            k.normal_(), v.normal_()
        return r

    tables = [[3, 4, 9], [5, 6], [8, 10, 11, 12]]
    step = StepInput([[7 + i + j for j in range(q)] for i in range(3)], [17, 12, 26], tables, [num_logits] * 3,
                     position_offsets=None if offsets is None else torch.tensor(offsets))
    eager, graphed = runner(), runner()
    expected = eager.run(step)
    graphed.init_graph_io(max_batch_size=8, max_model_len=256, query_lens=(1, 2, 4))
    bucket, got_q = graphed.stage_graph_inputs(step)
    assert (bucket, got_q) == (4, q)
    got = graphed.step_logits(graphed.graph_forward_static(bucket, q), step)
    torch.testing.assert_close(got, expected)
    for (k1, v1), (k2, v2) in zip(eager.kv_caches, graphed.kv_caches):
        torch.testing.assert_close(k1, k2)  # the same slots written, nothing else (padding included)
        torch.testing.assert_close(v1, v2)


def _graph_shapes(runner, query_lens) -> list:
    """The graph shape of each step the runner runs from now on (None: eager)."""
    shapes, real_run = [], runner.run

    def run(step, *args):
        shapes.append(graph_shape(step, {q: GRAPH_BATCH_SIZES for q in query_lens}))
        return real_run(step, *args)

    runner.run = run
    return shapes


def test_overlapped_decode_and_verification_steps_fit_a_graph(tiny_llama):
    """Every step after the prefill fits a captured graph: overlapped plain decode (before, its
    position offsets made it run eagerly), and verification steps of a fixed k with overlap."""
    plain = LLMEngine(EngineConfig(model=str(tiny_llama), async_scheduling=True))
    shapes = _graph_shapes(plain.runner, (1,))
    _decode(plain, [[5, 6, 7, 8], [9, 10, 11]])
    assert shapes[0] is None and shapes[1:] == [(2, 1)] * (len(shapes) - 1)
    del plain  # on CUDA its KV pool would leave the next engine no room

    spec = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="draft", draft_model=str(tiny_llama),
                                  num_speculative_tokens=3, adaptive_speculation=False, async_scheduling=True))
    shapes = _graph_shapes(spec.runner, (1, 4))
    draft_shapes = _graph_shapes(spec.speculator.proposer.runner, (1, 2))
    _decode(spec, [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert shapes[0] is None and shapes[-1] is None  # the prefill; the last step, 2 tokens from max_tokens
    assert shapes[1:-1] == [(2, 4)] * (len(shapes) - 2) and len(shapes) >= 6
    # the draft: after its prefill, every forward fits, among them those that read [the token
    # before the last, the last] after a verification
    assert draft_shapes[0] is None and None not in draft_shapes[1:] and (2, 2) in draft_shapes


@pytest.fixture(scope="module")
def close_draft(tiny_llama, tmp_path_factory) -> Path:
    """The target with its second layer's output halved: a draft it agrees with about a third of
    the time, so within a batch some requests have every draft accepted and others not."""
    path = tmp_path_factory.mktemp("close_draft")
    model = LlamaForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.5)
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    return path


def test_draft_forwards_fit_a_graph_when_acceptance_differs_within_a_batch(tiny_llama, close_draft, graphs_on_cpu):
    """Steps read back one at a time: after a verification that accepted every draft the draft
    has two tokens to read, after one that did not, one. Each reads two, so the first forward of
    a step has one shape for the whole batch and replays a graph (on an H200, at batch 64, a third
    of the draft's forwards ran eagerly: 28 ms a step)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="draft", draft_model=str(close_draft),
                                    num_speculative_tokens=3, adaptive_speculation=False, async_scheduling=False))
    draft_shapes = _graph_shapes(engine.speculator.proposer.runner, (1, 2))
    for i in range(4):
        engine.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert 0.15 < stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total < 0.85  # some accepted, not all
    assert draft_shapes[0] is None and None not in draft_shapes[1:] and len(draft_shapes) > 30
    assert (4, 2) in draft_shapes


def test_every_forward_of_a_speculative_step_with_mixed_k_fits_a_graph(tiny_llama, close_draft, graphs_on_cpu):
    """Requests whose k differs in one step (each is cut short near its max_tokens, at a different
    step): the draft's forwards keep one shape per forward (the first reads two tokens a request,
    each next one a token for each request still drafting), and so do the target's verifications
    while k is uniform; the drafts are one tensor for the batch, rows of k_i."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="draft", draft_model=str(close_draft),
                                    num_speculative_tokens=3, adaptive_speculation=False, async_scheduling=False))
    draft_shapes = _graph_shapes(engine.speculator.proposer.runner, (1, 2))
    ks_seen = set()
    propose = engine.speculator.proposer.propose

    def recording_propose(requests, ks, *args, **kwargs):
        ks_seen.add(tuple(sorted(ks)))
        proposals = propose(requests, ks, *args, **kwargs)
        assert [len(p.device_token_ids) for p in proposals] == list(ks)
        assert len({p.device_token_ids.untyped_storage().data_ptr() for p in proposals}) <= 1  # one tensor
        return proposals

    engine.speculator.proposer.propose = recording_propose
    for i, max_tokens in enumerate((40, 23, 17, 30)):
        engine.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(len(set(ks)) > 1 for ks in ks_seen), ks_seen  # the case is a real one
    assert draft_shapes[0] is None and None not in draft_shapes[1:], draft_shapes


def test_multi_token_graphs_stop_at_a_batch_of_64(tiny_llama):
    """Each graph keeps its float32 logits ([batch x q, vocab]), so verification graphs stop at a
    batch of 64 (where speculation still pays); decode graphs go up to max_num_seqs."""
    model, _ = load_model(tiny_llama, "float32", torch.device("cpu"), 256)
    runner = ModelRunner(model, TorchAttention(), num_blocks=32, block_size=8, device=torch.device("cpu"),
                         dtype=torch.float32)
    runner.init_graph_io(max_batch_size=256, max_model_len=256, query_lens=(1, 5))
    assert max(runner.graph_sizes[1]) == 256 and max(runner.graph_sizes[5]) == 64
    assert runner.graph_sizes[5] == tuple(b for b in runner.graph_sizes[1] if b <= 64)


def test_which_target_graphs_every_rank_captures(tiny_llama):
    """On CUDA the target captures decode graphs and, with speculation, verification graphs (k + 1
    tokens); under tensor parallelism every rank captures the same ones (their all-reduces meet in
    the graphs); a pipeline's stages, a CPU, enforce_eager and an attention that syncs capture none."""
    from backend.model.model_runner import target_graph_query_lens

    cuda, triton, torch_attention = torch.device("cuda", 1), TritonAttention(), TorchAttention()

    def lens(device=cuda, attention=triton, **overrides):
        return target_graph_query_lens(EngineConfig(model=str(tiny_llama), **overrides), device, attention)

    assert lens() == (1,)
    assert lens(speculative_method="ngram", num_speculative_tokens=3) == (1, 4)
    assert lens(tensor_parallel_size=2) == (1,)
    assert lens(pipeline_parallel_size=2) == ()
    assert lens(enforce_eager=True) == ()
    assert lens(device=torch.device("cpu")) == ()
    assert lens(attention=torch_attention) == ()
