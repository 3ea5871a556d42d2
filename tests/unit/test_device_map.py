"""Where each llm_engine instance runs: KIND_GPU, gpu_device_ids groups, and the clear errors of
a bad map."""
from __future__ import annotations

import pytest

from backend.errors import ValidationError
from serving.device_map import (InstancePlacement, check_nodes, instance_device, instance_placement,
                                parse_gpu_device_ids)

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
