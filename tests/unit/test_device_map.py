"""Where each llm_engine instance and each of its ranks runs: KIND_GPU, gpu_device_ids groups, a
GPU per tensor-parallel rank, and the clear errors of a bad map."""
from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.device import check_gpus, device_of_rank, rank_device
from backend.errors import ValidationError
from serving.triton.device_map import (
    InstancePlacement,
    check_nodes,
    instance_device,
    instance_gpu_ids,
    instance_placement,
    parse_gpu_device_ids,
)

CONFIG = {"instance_group": [{"name": "llm_engine_0", "count": 2}, {"name": "llm_engine_1", "count": 3}]}


def test_the_index_counts_over_the_instance_groups():
    assert instance_placement({"model_instance_name": "llm_engine_0_1"}, CONFIG).index == 1
    placement = instance_placement({"model_instance_name": "llm_engine_1_2", "model_instance_kind": "GPU",
                                    "model_instance_device_id": "3"}, CONFIG)
    assert placement == InstancePlacement("GPU", 3, 4, 5)


def test_kind_gpu_runs_on_its_gpu():
    assert instance_device(InstancePlacement("GPU", 2, 1, 4), "auto", "", 1, 4) == "cuda:2"
    with pytest.raises(ValidationError, match="tensor_parallel_size: above 1 needs KIND_MODEL"):
        instance_device(InstancePlacement("GPU", 2, 1, 4), "auto", "", 2, 4)


def test_gpu_device_ids_give_each_instance_its_group():
    assert parse_gpu_device_ids("0,1; 2,3") == [[0, 1], [2, 3]]
    assert [instance_device(InstancePlacement("MODEL", 0, i, 2), "auto", "2;0", 1, 4) for i in range(2)] == \
        ["cuda:2", "cuda:0"]


@pytest.mark.parametrize("ids, tp, gpus, message", [
    ("0;1", 1, 1, "GPU 1 is not on this host \\(1 GPUs\\)"),
    ("0,1;1,2", 2, 4, "GPU 1 is in two groups"),
    ("0", 1, 4, "has 1 groups for 2 instances"),
    ("0,1;2", 2, 4, "group \\[2\\] has 1 GPUs; each needs tensor_parallel_size \\(2\\)"),
    ("0;x", 1, 4, "must be GPU ids like"),
])
def test_a_bad_map_fails_the_load_naming_it(ids, tp, gpus, message):
    with pytest.raises(ValidationError, match=f"gpu_device_ids: {message}"):
        instance_device(InstancePlacement("MODEL", 0, 0, 2), "auto", ids, tp, gpus)


def test_several_instances_on_gpus_need_a_map_but_on_cpus_do_not():
    with pytest.raises(ValidationError, match="would all run on GPU 0"):
        instance_device(InstancePlacement("MODEL", 0, 1, 2), "auto", "", 1, 2)
    assert instance_device(InstancePlacement("CPU", 0, 1, 2), "auto", "", 1, 0) == "auto"
    assert instance_device(InstancePlacement("MODEL", 0, 0, 1), "cuda", "", 1, 1) == "cuda"


def test_ranks_across_nodes_serve_one_instance():
    check_nodes(InstancePlacement("CPU", 0, 0, 1), 2)
    check_nodes(InstancePlacement("CPU", 0, 1, 2), 1)
    with pytest.raises(ValidationError, match=r"nnodes: above 1 needs one instance \(instance_group has 2\)"):
        check_nodes(InstancePlacement("CPU", 0, 1, 2), 2)


def _engine_config(tmp_path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(tmp_path), **overrides)


def test_every_tensor_parallel_rank_of_every_instance_gets_its_own_gpu(tmp_path):
    """Two KIND_MODEL instances with tensor_parallel_size 2 and the map "0,1;2,3": instance 1's
    ranks run on GPUs 2 and 3, never on GPU 0 (Triton server #6855, #8235)."""
    devices = []
    for index in range(2):
        placement = InstancePlacement("MODEL", 0, index, 2)
        config = _engine_config(tmp_path, device=instance_device(placement, "auto", "0,1;2,3", 2, 4),
                                gpu_device_ids=instance_gpu_ids(placement, "0,1;2,3"), tensor_parallel_size=2)
        devices.append([str(device_of_rank(config, rank)) for rank in range(2)])
    assert devices == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]


def test_ranks_without_a_map_take_the_gpus_from_rank_0s_on_and_other_nodes_their_local_ones():
    gpu = torch.device("cuda", 2)
    assert [str(rank_device(gpu, rank, ranks_per_node=2)) for rank in range(4)] == \
        ["cuda:2", "cuda:3", "cuda:0", "cuda:1"]  # ranks 2 and 3 on the second node: its LOCAL_RANK 0 and 1
    assert str(rank_device(torch.device("cuda"), 1, 2, (5, 7))) == "cuda:7"
    assert rank_device(torch.device("cpu"), 3, 2) == torch.device("cpu")


def test_a_gpu_map_that_does_not_fit_the_ranks_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValidationError, match="gpu_device_ids: must name 2 different GPUs"):
        _engine_config(tmp_path, tensor_parallel_size=2, gpu_device_ids="1,1")
    with pytest.raises(ValidationError, match="gpu_device_ids: must name 2 different GPUs"):
        _engine_config(tmp_path, tensor_parallel_size=2, gpu_device_ids="1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a host of two GPUs
    check_gpus(_engine_config(tmp_path, device="cuda:0", tensor_parallel_size=2))
    with pytest.raises(ValidationError, match=r"tensor_parallel_size: the 2 rank\(s\) on this node need GPUs \[1, 2\]"):
        check_gpus(_engine_config(tmp_path, device="cuda:1", tensor_parallel_size=2))
    with pytest.raises(ValidationError, match="gpu_device_ids: .* need GPUs \\[0, 3\\]; this host has 2"):
        check_gpus(_engine_config(tmp_path, device="cuda", tensor_parallel_size=2, gpu_device_ids="0,3"))
