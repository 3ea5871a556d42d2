"""The runner's host inputs: a decode graph gets the same rows as an eager step, plus padding."""
import torch

from backend.attention import TorchAttention
from backend.model_loader import load_model
from backend.model_runner import PAD_BLOCK, PAD_SLOT, ModelRunner, StepInput


def test_graph_inputs_are_the_eager_inputs_plus_padding_rows(tiny_llama):
    model, _ = load_model(tiny_llama, "float32", torch.device("cpu"), 256)
    runner = ModelRunner(model, TorchAttention(), num_blocks=32, block_size=8, device=torch.device("cpu"),
                         dtype=torch.float32)
    step = StepInput(token_ids=[[5], [9], [200]], start_positions=[0, 17, 40],
                     block_tables=[[3], [4, 7, 2], [9, 10, 11, 12, 13, 14]], num_logits=[1, 1, 1])
    input_ids, positions, meta, logits_indices = runner.prepare(step)
    graph = runner.graph_inputs(step, bucket=4, max_blocks=8)

    assert graph["input_ids"].tolist() == input_ids.tolist() + [0]
    assert graph["positions"].tolist() == positions.tolist() + [0]
    assert graph["slot_mapping"].tolist() == [3 * 8 + 0, 2 * 8 + 1, 14 * 8 + 0, PAD_SLOT]
    assert meta.slot_mapping.tolist() == graph["slot_mapping"].tolist()[:3]
    assert graph["seq_lens"].tolist() == meta.seq_lens.tolist() + [1] == [1, 18, 41, 1]
    assert graph["block_tables"].shape == (4, 8)
    assert graph["block_tables"][:3, :6].tolist() == meta.block_tables.tolist()
    assert (graph["block_tables"][3] == PAD_BLOCK).all() and (graph["block_tables"][:, 6:] == PAD_BLOCK).all()
    assert logits_indices.tolist() == [0, 1, 2]
