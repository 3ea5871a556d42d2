"""Pipeline parallelism applied to a loaded model from outside it: stage s of P keeps a contiguous
run of the decoder layers, the embeddings go with the first stage, the final norm and lm_head with
the last. A stage after the first takes the previous stage's hidden states and residuals instead
of token ids; a stage before the last hands its own on (backend/parallel/worker_group.py carries them).

Ranks: tensor_parallel_size T ranks per stage, rank = stage * T + tp_rank, so rank 0 is stage 0's
first rank (the engine) and a node of T ranks holds one whole stage. Like tensor parallelism, the
cut is made on the meta device and the loader reads only the stage's checkpoint tensors
(`stage_parameter_name`), so a stage never holds another stage's weights.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from torch import nn

from backend.model.model import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True, slots=True)
class PipelineStage:
    stage: int
    num_stages: int
    layers: range  # the model's decoder layers this stage runs

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def pipeline_stage(num_layers: int, stage: int, num_stages: int, partition: str = "") -> PipelineStage:
    """Stage `stage`'s layers: `partition` ("5,4": layers per stage, vLLM's VLLM_PP_LAYER_PARTITION),
    or num_layers split as evenly as possible, the earlier stages taking one more when it does not
    divide. The last stage also runs the norm and lm_head: with a large vocabulary, a partition that
    gives it fewer layers balances the stages."""
    if partition:
        sizes = [int(n) for n in partition.split(",")]
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"pipeline_layer_partition {partition!r} must give each of the {num_stages} stages "
                             f"at least one layer, {num_layers} layers in all")
        start = sum(sizes[:stage])
        return PipelineStage(stage, num_stages, range(start, start + sizes[stage]))
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
    size, extra = divmod(num_layers, num_stages)
    start = stage * size + min(stage, extra)
    return PipelineStage(stage, num_stages, range(start, start + size + (stage < extra)))


def stage_parameter_name(name: str, stage: PipelineStage, tied: bool) -> str | None:
    """Where checkpoint tensor `name` goes in the stage's model (its layers renumbered from 0);
    None when the stage does not hold it. With tied embeddings a last stage that is not the first
    reads its lm_head from the embedding table."""
    layer = _LAYER.match(name)
    if layer is not None:
        index = int(layer.group(1))
        return f"model.layers.{index - stage.layers.start}.{layer.group(2)}" if index in stage.layers else None
    if name.startswith("model.embed_tokens."):
        if stage.is_first:
            return name
        return "lm_head.weight" if tied and stage.is_last else None
    if name.startswith(("model.norm.", "lm_head.")):
        return name if stage.is_last else None
    return name


def split_model(model: LlamaForCausalLM, stage: PipelineStage) -> None:
    """Cut a model (on the meta device) down to one stage, in place: the modules it does not run
    become None, and `model.args.num_layers` counts its own layers (the KV pool it needs)."""
    model.model.layers = nn.ModuleList(model.model.layers[i] for i in stage.layers)
    if not stage.is_first:
        model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm = None
        model.lm_head = None
    elif not stage.is_first and model.args.tie_word_embeddings:  # its own copy of the shared table
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.data.clone(), requires_grad=False)
    model.args = dataclasses.replace(model.args, num_layers=len(stage.layers))
