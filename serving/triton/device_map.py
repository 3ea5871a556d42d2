"""Which device each instance of llm_engine runs on, from Triton's instance_group.

- KIND_GPU: Triton gives each instance a GPU (`model_instance_device_id`); the engine runs there.
  Each instance is one GPU, so tensor_parallel_size must be 1.
- `gpu_device_ids` (TensorRT-LLM's convention, "0,1;2,3"): instance i runs on the i-th group of
  GPUs, tensor_parallel_size of them (rank r on the group's r-th); no GPU in two groups, a group
  for every instance, every GPU present. Use it with KIND_MODEL (or KIND_CPU, which only says
  where Triton runs the instance).
- Otherwise the `device` parameter as it is. Several instances on CUDA without a map would all
  land on GPU 0, so that is refused.
- Ranks across nodes (`nnodes` above 1) meet at one port, with one set of nodes: one instance.

The instance's index is the `_N` suffix Triton gives its name, counted over the instance groups
in order.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.errors import ValidationError


@dataclass(frozen=True, slots=True)
class InstancePlacement:
    kind: str  # Triton's model_instance_kind: "GPU", "CPU" or "MODEL"
    device_id: int  # Triton's model_instance_device_id (KIND_GPU)
    index: int  # this instance among all of the model's, from 0
    count: int  # the model's instances, over every instance group


def instance_placement(args: dict, model_config: dict) -> InstancePlacement:
    """This instance's kind, device and index, from initialize()'s args and the model config."""
    name = args.get("model_instance_name", "")
    index, offset = 0, 0
    for group in model_config.get("instance_group", []):
        count = int(group.get("count", 1))
        prefix = f"{group.get('name', '')}_"
        if group.get("name") and name.startswith(prefix) and name[len(prefix):].isdigit():
            index = offset + int(name[len(prefix):])
        offset += count
    return InstancePlacement(args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0)),
                             index, max(offset, 1))


def parse_gpu_device_ids(value: str) -> list[list[int]]:
    """ "0,1;2,3" -> [[0, 1], [2, 3]] (empty: no map)."""
    if not value.strip():
        return []
    try:
        return [[int(gpu) for gpu in group.split(",")] for group in value.replace(" ", "").split(";")]
    except ValueError:
        raise ValidationError("gpu_device_ids", f'must be GPU ids like "0,1;2,3", got {value!r}') from None


def instance_device(placement: InstancePlacement, device: str, gpu_device_ids: str, tensor_parallel_size: int,
                    num_gpus: int) -> str:
    """The device this instance's engine runs on ("cpu", "cuda:N", or `device` unchanged)."""
    groups = parse_gpu_device_ids(gpu_device_ids)
    if placement.kind == "GPU":
        if groups:
            raise ValidationError("gpu_device_ids", "is for KIND_MODEL instances; KIND_GPU places each on its GPU")
        if tensor_parallel_size > 1:
            raise ValidationError("tensor_parallel_size", "above 1 needs KIND_MODEL and gpu_device_ids "
                                  "(a KIND_GPU instance has one GPU)")
        return f"cuda:{placement.device_id}"
    if not groups:
        on_gpus = device.startswith("cuda") or (device == "auto" and num_gpus > 0)
        if placement.count > 1 and on_gpus:
            raise ValidationError("gpu_device_ids", f"is needed for {placement.count} instances on GPUs "
                                  "(without it they would all run on GPU 0), or use KIND_GPU")
        return device
    _check_groups(groups, placement.count, tensor_parallel_size, num_gpus)
    return f"cuda:{groups[placement.index][0]}"


def instance_gpu_ids(placement: InstancePlacement, gpu_device_ids: str) -> str:
    """The engine's `gpu_device_ids`: this instance's group ("2,3", a GPU per tensor-parallel rank;
    checked by instance_device), or "" without a map."""
    groups = parse_gpu_device_ids(gpu_device_ids)
    return ",".join(map(str, groups[placement.index])) if groups and placement.kind != "GPU" else ""


def check_nodes(placement: InstancePlacement, nnodes: int) -> None:
    if nnodes > 1 and placement.count > 1:
        raise ValidationError("nnodes", f"above 1 needs one instance (instance_group has {placement.count}): "
                              "the instances would share master_port and the other nodes")


def _check_groups(groups: list[list[int]], count: int, tensor_parallel_size: int, num_gpus: int) -> None:
    if len(groups) < count:
        raise ValidationError("gpu_device_ids", f"has {len(groups)} groups for {count} instances")
    seen: set[int] = set()
    for group in groups:
        if len(group) != tensor_parallel_size:
            raise ValidationError("gpu_device_ids", f"group {group} has {len(group)} GPUs; "
                                  f"each needs tensor_parallel_size ({tensor_parallel_size})")
        for gpu in group:
            if gpu in seen:
                raise ValidationError("gpu_device_ids", f"GPU {gpu} is in two groups")
            if not 0 <= gpu < num_gpus:
                raise ValidationError("gpu_device_ids", f"GPU {gpu} is not on this host ({num_gpus} GPUs)")
            seen.add(gpu)
