"""perf/random_checkpoints.write_pair: a random-weight pair whose draft's greedy agreement with the target is set."""
from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from perf.random_checkpoints import PROMPT_LEN, SHAPE_TINY, agreement, write_pair


def test_the_pair_agrees_as_asked_and_the_draft_is_the_targets_first_layer(tmp_path):
    found = write_pair(tmp_path, SHAPE_TINY, 0.6, torch.device("cpu"), torch.float32)
    assert abs(found["agreement"] - 0.6) < 0.05 and found["eps"] > 0
    target = LlamaForCausalLM.from_pretrained(tmp_path / "target").eval()
    draft = LlamaForCausalLM.from_pretrained(tmp_path / "draft").eval()
    assert len(draft.model.layers) == 1 < len(target.model.layers)
    for name, weight in draft.state_dict().items():  # embedding, first layer, norm, head: the target's own
        torch.testing.assert_close(weight, target.state_dict()[name], rtol=0, atol=0)
    # measured again on the checkpoints as written: the agreement the search reported
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, target.config.vocab_size, (16, PROMPT_LEN), generator=generator)
    target.generation_config.eos_token_id = None
    assert agreement(target, draft, prompts) == found["agreement"]
