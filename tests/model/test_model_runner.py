"""The runner's host inputs: a decode graph gets the same rows as an eager step, plus padding."""
import torch

from backend.model.attention import TorchAttention
from backend.model.model_loader import load_model
from backend.model.model_runner import PAD_BLOCK, PAD_SLOT, ModelRunner, StepInput


def test_graph_inputs_are_the_eager_inputs_plus_padding_rows(tiny_llama):
    model, _ = load_model(tiny_llama, "float32", torch.device("cpu"), 256)
    runner = ModelRunner(model, TorchAttention(), num_blocks=32, block_size=8, device=torch.device("cpu"),
                         dtype=torch.float32)
    step = StepInput(token_ids=[[5], [9], [200]], start_positions=[0, 17, 40],
                     block_tables=[[3], [4, 7, 2], [9, 10, 11, 12, 13, 14]], num_logits=[1, 1, 1])
    input_ids, positions, meta, logits_indices = runner.prepare(step)
    runner.init_decode_inputs(max_batch_size=8, max_blocks=8)
    graph = runner.graph_inputs(step, bucket=4)

    assert graph["input_ids"].tolist() == input_ids.tolist() + [0]
    assert graph["positions"].tolist() == positions.tolist() + [0]
    assert graph["slot_mapping"].tolist() == [3 * 8 + 0, 2 * 8 + 1, 14 * 8 + 0, PAD_SLOT]
    assert meta.slot_mapping.tolist() == graph["slot_mapping"].tolist()[:3]
    assert graph["seq_lens"].tolist() == meta.seq_lens.tolist() + [1] == [1, 18, 41, 1]
    assert graph["block_tables"].shape == (4, 6)  # uploaded: as wide as the step's widest table, not max_blocks
    assert graph["block_tables"][:3].tolist() == meta.block_tables.tolist()
    assert (graph["block_tables"][3] == PAD_BLOCK).all()
    assert logits_indices.tolist() == [0, 1, 2]


def test_graph_inputs_rewrite_the_rows_whose_tables_changed(tiny_llama):
    """Staging rows are reused between steps: a row holds the right table after its request grew,
    shrank and regrew to the same length with another block, and after requests moved rows."""
    model, _ = load_model(tiny_llama, "float32", torch.device("cpu"), 256)
    runner = ModelRunner(model, TorchAttention(), num_blocks=32, block_size=8, device=torch.device("cpu"),
                         dtype=torch.float32)
    runner.init_decode_inputs(max_batch_size=8, max_blocks=8)

    def live_rows(tables, starts, bucket):
        step = StepInput([[1]] * len(tables), starts, tables, [1] * len(tables))
        graph = runner.graph_inputs(step, bucket)
        rows = [graph["block_tables"][i, : len(t)].tolist() for i, t in enumerate(tables)]
        return rows, graph["seq_lens"].tolist(), graph["slot_mapping"].tolist()

    a, b, c = [3, 4], [5, 6, 7], [8]
    assert live_rows([a, b, c], [9, 20, 0], 4)[0] == [a, b, c]
    a.append(9)  # crossed a block boundary
    b.pop(); b.append(11)  # rolled back, then grew to the same length with another block
    assert live_rows([a, b, c], [16, 20, 1], 4)[0] == [[3, 4, 9], [5, 6, 11], [8]]
    rows, seq_lens, slots = live_rows([c, a], [2, 17], 4)  # a request finished: the others moved up
    assert rows == [[8], [3, 4, 9]]
    assert seq_lens == [3, 18, 1, 1] and slots == [8 * 8 + 2, 9 * 8 + 1, PAD_SLOT, PAD_SLOT]
    graph = runner.graph_inputs(StepInput([[1]], [2], [c], [1]), 2)
    assert graph["block_tables"][1, 0] == PAD_BLOCK and graph["slot_mapping"].tolist() == [8 * 8 + 2, PAD_SLOT]
