"""Pipeline parallelism: stages that each hold a run of the layers compute the whole model's
logits; the engine with pipeline_parallel_size 2 (and 2 x 2 with tensor parallelism) gives one
rank's tokens, with several batches in flight, preemption, prefix caching and speculation; a second "node"
started by its own command joins on loopback; a dead stage or node ends every request."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from backend.model.attention import TorchAttention
from backend.config import EngineConfig
from backend.parallel.distributed import RANK_SECRET_VARIABLE
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.errors import ENGINE_DEAD, FatalEngineError, ValidationError
from backend.model.model_loader import load_model
from backend.model.model_runner import ModelRunner, StepInput
from backend.parallel.node import VARIABLES
from backend.model.pipeline_parallel import pipeline_stage
from backend.sampling_params import SamplingParams
from tests.conftest import free_port, write_tiny_model
from tests.model.test_engine_core import Collector
from tests.model.test_engine_vs_hf import hf_greedy, mixed_prompts, run_engine
from tests.model.test_tensor_parallel import _seeded


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("four_layers"), "llama", seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def expected(four_layers):
    """One rank's greedy and seeded tokens for the prompts every engine test runs."""
    prompts, max_tokens = mixed_prompts(12, seed=4)
    engine = LLMEngine(EngineConfig(model=str(four_layers)))
    return prompts, max_tokens, run_engine(engine, prompts, max_tokens), _seeded(engine, prompts[:6])


def test_stage_layers():
    assert [pipeline_stage(5, s, 2).layers for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [pipeline_stage(4, s, 4).layers for s in range(4)] == [range(i, i + 1) for i in range(4)]
    assert pipeline_stage(6, 2, 3).is_last and not pipeline_stage(6, 1, 3).is_first
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        pipeline_stage(2, 0, 3)
    assert [pipeline_stage(9, s, 2, "5,4").layers for s in range(2)] == [range(0, 5), range(5, 9)]
    assert [pipeline_stage(4, s, 3, "1,1,2").layers for s in range(3)] == [range(0, 1), range(1, 2), range(2, 4)]
    for partition in ("5,3", "9,0"):
        with pytest.raises(ValueError, match="must give each of the 2 stages at least one layer, 9 layers in all"):
            pipeline_stage(9, 0, 2, partition)


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stages_in_a_row_compute_the_whole_model(arch, num_stages, tmp_path):
    """Each stage loads only its layers (the first the embeddings, the last the norm and lm_head,
    tied to the embeddings in Qwen2's checkpoint); run one after the other over a prefill and a
    decode step, they give the whole model's logits exactly."""
    model_dir = write_tiny_model(tmp_path, arch, num_hidden_layers=3, tie_word_embeddings=arch == "qwen2")
    cpu = torch.device("cpu")
    whole = load_model(model_dir, "float32", cpu, 64)[0]
    stages = [load_model(model_dir, "float32", cpu, 64, stage=pipeline_stage(3, s, num_stages))[0]
              for s in range(num_stages)]
    assert sum(len(m.model.layers) for m in stages) == 3
    assert [m.model.embed_tokens is not None for m in stages] == [True] + [False] * (num_stages - 1)
    assert [m.lm_head is not None for m in stages] == [False] * (num_stages - 1) + [True]
    assert sum(p.numel() for m in stages for p in m.parameters()) == (
        sum(p.numel() for p in whole.parameters()) + (whole.lm_head.weight.numel() if arch == "qwen2" else 0))
    runners = [ModelRunner(m, TorchAttention(), 4, 8, cpu, torch.float32) for m in [whole] + stages]
    prefill, decode = StepInput([], [], [], []), StepInput([], [], [], [])
    prefill.add([5, 9, 200, 17, 3], 0, [0], 2)
    prefill.add([100, 7], 0, [1], 1)
    decode.add([42], 5, [0], 1)
    decode.add([8], 2, [1], 1)
    for step in (prefill, decode):
        out = None
        for runner in runners[1:]:
            out = runner.run(step, out)
        assert torch.equal(out, runners[0].run(step))


def _step_all(engine: LLMEngine, prompts, max_tokens) -> tuple[list[list[int]], int]:
    """Greedy tokens; asserts that the batches in flight never share a request, and returns how
    many batches were collected with the most batches in flight."""
    full, sample = 0, engine._sample

    def checked_sample(step):
        nonlocal full
        steps = [step, *engine.in_flight] if not step.sampled else []  # it left the queue to be sampled
        in_flight = [r.request_id for s in steps for r in s.batch.requests]
        assert len(in_flight) == len(set(in_flight))
        full += len(steps) == engine.config.max_batches_in_flight
        return sample(step)

    engine._sample = checked_sample
    return run_engine(engine, prompts, max_tokens), full


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_engine_outputs_equal_one_rank(four_layers, expected, tensor_parallel_size):
    """PP=2 and TP=2 x PP=2: greedy tokens identical to one rank's and to HF, seeded sampling
    identical; two batches of different requests are in the pipeline at once."""
    prompts, max_tokens, greedy, seeded = expected
    engine = LLMEngine(EngineConfig(model=str(four_layers), tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=2, max_num_seqs=6))
    try:
        tokens, full = _step_all(engine, prompts, max_tokens)
        assert tokens == greedy
        assert full > 0
        assert _seeded(engine, prompts[:6]) == seeded
        assert run_engine(engine, [prompts[0]], [16]) == [hf_greedy(four_layers, prompts[0], 16)]
        # the same prompt again shares its third block's head, which the answer filled: those K/V
        # rows are copied on every stage (and rank) before the step reads them
        again = list(range(10, 52))  # 42 tokens: two full blocks of 16, then 10
        assert run_engine(engine, [again], [8]) == [hf_greedy(four_layers, again, 8)]
        copies = _record_copies(engine)
        assert run_engine(engine, [again], [4]) == [hf_greedy(four_layers, again, 4)]
        assert copies == [9]
        _abort_in_flight(engine, prompts, max_tokens, greedy)
    finally:
        engine.close()
    assert all(w.poll() is not None for w in engine.workers.workers)
    assert len(engine.workers.stage_busy) == 2 * tensor_parallel_size - 1  # every worker's forwards


def _record_copies(engine: LLMEngine) -> list[int]:
    """From now on, the token count of every block copy the engine's steps ask for."""
    made, take = [], engine.block_manager.take_copies

    def recording(requests):
        copies = take(requests)
        made.extend(n for _, _, n in copies)
        return copies

    engine.block_manager.take_copies = recording
    return made


def _abort_in_flight(engine: LLMEngine, prompts, max_tokens, greedy) -> None:
    """Abort a request whose batch is in the pipeline (its blocks freed at once), then start one
    that may take them: the batch-mates and the newcomer still get one rank's tokens."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts[:4], max_tokens[:4])]
    assert engine.step() == [] and len(engine.in_flight) == 1
    victim = engine.in_flight[0].batch.requests[0].request_id
    assert engine.abort(victim).finished
    ids.append(engine.add_request(prompts[4], SamplingParams(max_tokens=max_tokens[4], temperature=0.0,
                                                             ignore_eos=True)))
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    assert [tokens[i] for i in ids if i != victim] == [g for i, g in zip(ids, greedy[:5]) if i != victim]


def test_preemption_and_prefix_caching_under_pp(four_layers, expected):
    """A KV pool too small for the batch preempts (never a request in flight), prompts that share
    a prefix hit the cache, and the tokens stay one rank's; so do one batch in flight and stages
    of 3 and 1 layers."""
    prompts, max_tokens, _, _ = expected
    shared = [7, 7, 8, 9] * 8  # two full blocks of 16
    prompts = [shared + p[:10] for p in prompts]
    config = dict(model=str(four_layers), num_kv_blocks=12, max_num_seqs=8)
    want = run_engine(LLMEngine(EngineConfig(**config)), prompts, max_tokens)
    for in_flight, partition in ((2, ""), (1, "3,1")):
        engine = LLMEngine(EngineConfig(**config, pipeline_parallel_size=2, max_batches_in_flight=in_flight,
                                        pipeline_layer_partition=partition))
        try:
            tokens, full = _step_all(engine, prompts, max_tokens)
            stats = engine.stats()
        finally:
            engine.close()
        assert tokens == want
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hit_tokens_total > 0
        assert stats.num_free_blocks == 12  # every block back (the cached ones reusable)
        assert full > 0


def test_speculation_under_pp(four_layers, expected):
    """A draft model on rank 0 proposes for each batch as it is launched; the last stage's logits
    verify them. Greedy tokens stay one rank's without speculation, drafts are accepted, and
    seeded sampling equals one rank's with the same fixed k (adaptive k is off under PP)."""
    prompts, max_tokens, greedy, _ = expected
    spec = dict(model=str(four_layers), speculative_method="draft", draft_model=str(four_layers),
                num_speculative_tokens=3, max_num_seqs=6)
    seeded = _seeded(LLMEngine(EngineConfig(**spec, adaptive_speculation=False)), prompts[:6])
    engine = LLMEngine(EngineConfig(**spec, pipeline_parallel_size=2))
    try:
        tokens, full = _step_all(engine, prompts, max_tokens)
        assert tokens == greedy and full > 0
        assert engine.stats().spec_accepted_tokens_total > 0
        assert _seeded(engine, prompts[:6]) == seeded
    finally:
        engine.close()


def test_pipeline_configs_that_cannot_run_are_refused(four_layers):
    def config(**kw):
        return EngineConfig(model=str(four_layers), pipeline_parallel_size=2, **kw)

    with pytest.raises(ValidationError, match="async_scheduling: must be off"):
        config(async_scheduling=True)
    with pytest.raises(ValidationError, match=r"max_batches_in_flight: must be in \[1, pipeline_parallel_size \(2\)\]"):
        config(max_batches_in_flight=3)
    with pytest.raises(ValidationError, match=r"nnodes: must divide .* \(2\), got 3"):
        config(nnodes=3)
    with pytest.raises(ValidationError, match="master_port: must be in"):
        config(nnodes=2)
    with pytest.raises(ValidationError, match="pipeline_parallel_size: pipeline_parallel_size 8 exceeds"):
        LLMEngine(EngineConfig(model=str(four_layers), pipeline_parallel_size=8))
    with pytest.raises(ValidationError, match="pipeline_layer_partition: must be 2 comma-separated layer counts"):
        config(pipeline_layer_partition="4")
    with pytest.raises(ValidationError, match="pipeline_layer_partition: pipeline_layer_partition '3,2' must give"):
        LLMEngine(config(pipeline_layer_partition="3,2"))


def _submit(loop: EngineLoop, n: int) -> Collector:
    collector = Collector()
    collector.expected = n
    for _ in range(n):
        loop.submit([5, 6, 7], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), collector)
    return collector


def _ends_dead_within(collector: Collector, seconds: float) -> None:
    """Every request (each still generating: max_tokens 500) ends with ENGINE_DEAD within `seconds`."""
    assert collector.done.wait(seconds)
    assert {o.error for o in collector.final.values()} == {ENGINE_DEAD}
    assert all(len(tokens) < 500 for tokens in collector.tokens.values())


def test_a_dead_stage_ends_every_request(four_layers):
    loop = EngineLoop(LLMEngine(EngineConfig(model=str(four_layers), pipeline_parallel_size=2)))
    loop.start()
    collector = _submit(loop, 3)
    assert collector.all_generating(3)  # each has tokens out and none has finished when the stage dies
    loop.engine.workers.workers[0].send_signal(signal.SIGKILL)
    _ends_dead_within(collector, 10)
    assert loop.dead
    loop.shutdown()


TEST_RANK_SECRET = "5ec2e7" * 8  # the operator's SPECSERVE_RANK_SECRET on every node


def start_node(port: int, world_size: int, local_world_size: int, node_rank: int) -> subprocess.Popen:
    """`python -m backend.parallel.node` with torchrun's rendezvous variables and the ranks' secret, as on
    another host."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(local_world_size), NODE_RANK=str(node_rank))
    env[RANK_SECRET_VARIABLE] = TEST_RANK_SECRET
    return subprocess.Popen([sys.executable, "-m", "backend.parallel.node"], env=env)


def test_a_second_node_serves_its_stage_and_its_death_ends_every_request(four_layers, expected, monkeypatch):
    """TP=2 x PP=2 over two "nodes": this process's engine and its worker are stage 0, a node
    command started on its own holds stage 1. Its tokens are one rank's; killing the node ends
    every request with the engine's error within seconds."""
    prompts, max_tokens, greedy, _ = expected
    monkeypatch.setenv(RANK_SECRET_VARIABLE, TEST_RANK_SECRET)
    port = free_port()
    config = EngineConfig(model=str(four_layers), tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                          master_port=port)
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(LLMEngine, config)  # the first node waits for the second
        time.sleep(1.0)
        assert not starting.done()
        node = start_node(port, 4, 2, 1)
    try:
        engine = starting.result()
        assert len(engine.workers.workers) == 1  # this node's other rank; the node runs ranks 2 and 3
        assert run_engine(engine, prompts, max_tokens) == greedy
        loop = EngineLoop(engine)
        loop.start()
        collector = _submit(loop, 3)
        time.sleep(0.5)
        node.send_signal(signal.SIGKILL)
        _ends_dead_within(collector, 10)
        loop.shutdown()
    finally:
        node.kill()
        node.wait()


def test_the_node_command_explains_its_variables():
    out = subprocess.run([sys.executable, "-m", "backend.parallel.node"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k not in VARIABLES})
    assert out.returncode == 2
    assert "set MASTER_ADDR, MASTER_PORT, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK" in out.stderr


@pytest.mark.parametrize("secret", [None, "not hex", "abcd"])
def test_the_node_command_needs_the_ranks_secret(secret):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
               NODE_RANK="1")
    env.pop(RANK_SECRET_VARIABLE, None)
    if secret is not None:
        env[RANK_SECRET_VARIABLE] = secret
    out = subprocess.run([sys.executable, "-m", "backend.parallel.node"], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert f"{RANK_SECRET_VARIABLE} must be set, to the same value on every node" in out.stderr
    assert secret is None or secret not in out.stderr  # never echoed


def test_an_engine_over_several_nodes_needs_the_ranks_secret(four_layers, monkeypatch):
    monkeypatch.delenv(RANK_SECRET_VARIABLE, raising=False)
    config = EngineConfig(model=str(four_layers), pipeline_parallel_size=2, nnodes=2, master_port=free_port())
    with pytest.raises(FatalEngineError, match=f"a world of 2 nodes needs the ranks' secret: "
                                               f"{RANK_SECRET_VARIABLE} must be set"):
        LLMEngine(config)
