"""The default draft/target pair shipped in model_repository/llm_engine/1 (trained by
scripts/train_default_models.py): loadable, consistent with each other, and able to continue text."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = Path(__file__).resolve().parent.parent / "model_repository" / "llm_engine" / "1"
NAMES = ("target", "draft")


@pytest.fixture(scope="module")
def tokenizers():
    return {name: AutoTokenizer.from_pretrained(MODEL_DIR / name) for name in NAMES}


@pytest.fixture(scope="module")
def models():
    return {name: AutoModelForCausalLM.from_pretrained(MODEL_DIR / name).eval() for name in NAMES}


def test_pair_is_a_small_llama_target_and_a_smaller_draft(models):
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert all(m.config.model_type == "llama" for m in models.values())
    assert 8e6 <= params["target"] <= 16e6
    assert params["draft"] <= 2e6
    weights = sum(f.stat().st_size for f in MODEL_DIR.glob("*/*.safetensors"))
    assert weights < 40e6


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", ["héllo wörld → 日本語 🚀\n\tdef f(x):",
                                  "  x = {'a': [1, 2]}  # ¿qué?\r\n\n\n    return None",
                                  ""])
def test_tokenizer_round_trips_text_exactly(tokenizers, name, text):
    tok = tokenizers[name]
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_draft_and_target_share_one_vocabulary(tokenizers, models):
    target_tok, draft_tok = tokenizers["target"], tokenizers["draft"]
    assert target_tok.get_vocab() == draft_tok.get_vocab()
    assert len(target_tok) == models["target"].config.vocab_size == models["draft"].config.vocab_size
    for m in models.values():
        assert (m.config.bos_token_id, m.config.eos_token_id, m.config.pad_token_id) == (
            target_tok.bos_token_id, target_tok.eos_token_id, target_tok.pad_token_id)
        assert m.generation_config.eos_token_id == target_tok.eos_token_id


def test_chat_template_ends_with_the_generation_prompt(tokenizers):
    tok = tokenizers["target"]
    messages = [{"role": "user", "content": "Write a function."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token)
    assert "Write a function." in text
    assert text.endswith("<|assistant|>\n")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_of_def_is_new_text(tokenizers, models, name):
    tok, model = tokenizers[name], models[name]
    prompt = tok("def ", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    new_ids = out[0, prompt.input_ids.shape[1]:]
    assert len(new_ids) == 16
    continuation = tok.decode(new_ids, skip_special_tokens=True)
    assert continuation
    full = tok.decode(out[0], skip_special_tokens=True)
    assert full.startswith("def ") and full != "def "
    if name == "target":  # the target writes code, not just indentation
        assert continuation.strip()
