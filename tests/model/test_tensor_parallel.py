"""Tensor parallelism: N gloo processes, each with its share of the model and of the KV cache,
compute the unsharded model's logits (at TP=4 the tiny Llama's 2 KV heads are replicated); the
engine with tensor_parallel_size N gives TP=1's tokens, with speculation too; a dead worker ends
every request."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.errors import ENGINE_DEAD
from backend.model.model_loader import load_model
from backend.sampling_params import SamplingParams
from backend.model.tensor_parallel import (
    ColumnParallelLinear,
    HeadShard,
    RankShare,
    RowParallelLinear,
    TensorParallelRank,
    head_shard,
    rank_share,
)
from tests.conftest import TINY_VOCAB, write_tiny_model
from tests.model.test_engine_core import Collector
from tests.model.test_engine_vs_hf import hf_greedy, mixed_prompts, run_engine
from tests.model.tensor_parallel_ranks import RANK_START_METHOD, generate, rank_main


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_sharded_ranks_compute_the_unsharded_model(arch, world_size, request, tmp_path):
    model_dir = str(request.getfixturevalue(arch))
    expected_logits, expected_tokens = generate(load_model(model_dir, "float32", torch.device("cpu"), 64)[0])
    out = tmp_path / "rank0.pt"
    mp.start_processes(rank_main, args=(world_size, model_dir, str(tmp_path / "rendezvous"), str(out)),
                       nprocs=world_size, start_method=RANK_START_METHOD)
    got = torch.load(out)
    assert got["tokens"] == expected_tokens  # greedy tokens identical
    for sharded, whole in zip(got["logits"], expected_logits):
        torch.testing.assert_close(sharded, whole, atol=1e-5, rtol=1e-4)
    assert got["kv_heads"] == max(2 // world_size, 1)  # the rank's own KV heads: 1, also when replicated
    assert got["vocab_rows"] == -(-TINY_VOCAB // world_size)  # rank 0's share of the vocabulary
    assert got["tied"] == (arch == "tiny_qwen2")  # tied embeddings stay one tensor


def _llama_with_biases(path) -> str:
    """A tiny Llama with attention and MLP biases, all of them non-zero."""
    write_tiny_model(path, "llama", seed=2, attention_bias=True, mlp_bias=True)
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            tensor.normal_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _expected_share(whole: torch.nn.Module, name: str, share: RankShare, rank: int) -> torch.Tensor | None:
    """Parameter `name` of rank `rank`, cut from the whole model's by hand (None: the rank has none)."""
    param = whole.get_parameter(name)
    kind = name.rpartition(".")[2]
    if name.startswith(("model.embed_tokens", "lm_head")):
        return param[share.vocab]
    if ".qkv_proj." in name:
        proj = whole.get_submodule(name.rpartition(".")[0])
        q, k, v = (param[proj.shard_rows(i)] for i in range(3))
        return torch.cat([q[share.q], k[share.kv], v[share.kv]])
    if ".gate_up_proj." in name:
        proj = whole.get_submodule(name.rpartition(".")[0])
        gate, up = (param[proj.shard_rows(i)] for i in range(2))
        return torch.cat([gate[share.mlp], up[share.mlp]])
    cut = share.q if ".o_proj." in name else share.mlp if ".down_proj." in name else None
    if cut is None:
        return param  # norms: replicated
    if kind == "bias":
        return param if rank == 0 else None  # added once, by rank 0
    return param[:, cut]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "llama_with_biases"])
def test_the_loader_reads_each_ranks_share_of_every_weight(arch, request, tmp_path):
    """Loading rank r of 4 gives tensor-parallel layers holding exactly the rows and columns of
    the whole model's weights that its share names (biases included: a row-parallel bias only on
    rank 0), a fraction of the model's parameters."""
    model_dir = _llama_with_biases(tmp_path) if arch == "llama_with_biases" else request.getfixturevalue(arch)
    whole, _ = load_model(model_dir, "float32", torch.device("cpu"), 64)
    whole_numel = sum(p.numel() for p in whole.parameters())
    for rank in range(4):
        tp = TensorParallelRank(rank, 4, lambda t: None, lambda t: [t])
        read, _ = load_model(model_dir, "float32", torch.device("cpu"), 64, tp)
        share = rank_share(whole.args, rank, 4)
        got = dict(read.named_parameters())
        expected = {name: _expected_share(whole, name, share, rank) for name, _ in whole.named_parameters()}
        assert got.keys() == {name for name, tensor in expected.items() if tensor is not None}
        for name, param in got.items():
            assert torch.equal(param, expected[name]), name
        layer = read.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, ColumnParallelLinear)
        assert isinstance(layer.mlp.down_proj, RowParallelLinear) and not layer.mlp.down_proj._forward_hooks
        assert (read.lm_head.weight is read.model.embed_tokens.weight) == (arch == "tiny_qwen2")
        assert sum(p.numel() for p in got.values()) < 0.5 * whole_numel


def test_head_shards():
    assert head_shard(8, 8, 1, 4) == HeadShard(range(2, 4), range(2, 4))
    assert [head_shard(8, 2, r, 4).kv_heads for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [head_shard(8, 4, r, 2) for r in range(2)] == [HeadShard(range(0, 4), range(0, 2)),
                                                         HeadShard(range(4, 8), range(2, 4))]
    with pytest.raises(ValueError, match="attention heads"):
        head_shard(6, 2, 0, 4)
    with pytest.raises(ValueError, match="KV heads must divide"):
        head_shard(12, 3, 0, 4)


# -- the engine with tensor_parallel_size > 1: rank 0 schedules and samples, workers run forwards --

def _seeded(engine, prompts) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True))
           for i, p in enumerate(prompts)]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("world_size", [2, 4])
def test_engine_outputs_equal_tp1(tiny_llama, world_size):
    """Greedy tokens identical to TP=1 and to HF, seeded sampling identical to TP=1 (at TP=4 the
    2 KV heads are replicated)."""
    prompts, max_tokens = mixed_prompts(12, seed=4)
    single = LLMEngine(EngineConfig(model=str(tiny_llama)))
    expected, expected_seeded = run_engine(single, prompts, max_tokens), _seeded(single, prompts[:6])
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=world_size))
    try:
        assert run_engine(engine, prompts, max_tokens) == expected
        assert _seeded(engine, prompts[:6]) == expected_seeded
        assert run_engine(engine, [prompts[0]], [16]) == [hf_greedy(tiny_llama, prompts[0], 16)]
    finally:
        engine.close()
    assert all(w.poll() is not None for w in engine.workers.workers)


def test_speculation_under_tp2_is_greedy_identical(tiny_llama):
    prompts, max_tokens = mixed_prompts(8, seed=5)
    expected = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, speculative_method="draft",
                                    draft_model=str(tiny_llama), adaptive_speculation=False))
    try:
        assert run_engine(engine, prompts, max_tokens) == expected
        assert engine.stats().spec_accepted_tokens_total > 0
    finally:
        engine.close()


def test_a_dead_worker_ends_every_request(tiny_llama):
    loop = EngineLoop(LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2)))
    collector = Collector()
    collector.expected = 3
    loop.start()
    for i in range(3):
        loop.submit([5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), collector)
    assert collector.all_generating(3)  # each has tokens out and none has finished when the worker dies
    loop.engine.workers.workers[0].send_signal(signal.SIGKILL)
    assert collector.done.wait(10)
    assert {o.error for o in collector.final.values()} == {ENGINE_DEAD}
    assert all(len(tokens) < 400 for tokens in collector.tokens.values())  # ended by the death, not by length
    assert loop.dead
    loop.shutdown()


# -- what users of Triton's LLM backends report breaking with several ranks ----------------------

_ENGINE_SCRIPT = """
import json, sys, time
from backend.config import EngineConfig
from backend.engine import LLMEngine
from tests.model.test_engine_vs_hf import mixed_prompts, run_engine
engine = LLMEngine(EngineConfig(model=sys.argv[1], tensor_parallel_size=2, num_threads=1))
print(json.dumps({"workers": [w.pid for w in engine.workers.workers]}), flush=True)
if sys.argv[2] == "generate":
    prompts, max_tokens = mixed_prompts(6, seed=9)
    print(json.dumps({"tokens": run_engine(engine, prompts, max_tokens)}), flush=True)
    engine.close()
else:
    time.sleep(600)  # until killed
"""


def _engine_process(model_dir, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _ENGINE_SCRIPT, str(model_dir), mode], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"  # a zombie is gone too


def test_workers_do_not_outlive_a_killed_engine(tiny_llama):
    """The engine's process dies without a word (SIGKILL, as when Triton's stub is killed): its
    tensor-parallel workers notice their parent is gone and exit (vllm #6766: orphans)."""
    engine = _engine_process(tiny_llama, "wait")
    workers = json.loads(engine.stdout.readline())["workers"]
    assert workers and all(_alive(pid) for pid in workers)
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)


def test_two_tensor_parallel_instances_on_one_host_do_not_collide(tiny_llama):
    """Two engines with tensor_parallel_size 2 at once on one host (two Triton instances): each has
    its own rendezvous, secret and ports, and both give TP=1's tokens (vllm #6614: shared names)."""
    prompts, max_tokens = mixed_prompts(6, seed=9)
    expected = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    engines = [_engine_process(tiny_llama, "generate") for _ in range(2)]
    outputs = []
    for engine in engines:
        out, _ = engine.communicate(timeout=300)
        assert engine.returncode == 0
        outputs.append(json.loads(out.splitlines()[-1])["tokens"])
    assert outputs == [expected, expected]
