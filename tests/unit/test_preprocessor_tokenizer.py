"""The preprocessing and llm models (and the gateway's chat template) load their tokenizer without
torch, and it is the tokenizer AutoTokenizer loads: the same class, ids, chat text, special tokens
and prompt-size bound, for every model the project serves; a model-specific class still goes
through AutoTokenizer. The gateway serves before guided decoding's checker (xgrammar, torch) loads."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from serving.triton.request_builder import Preprocessor, _longest_token_bytes, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "model_repository" / "llm_engine" / "1" / "target"
TINY_PAIR = ROOT / "tests" / "fixtures" / "tiny_pair"
TEXTS = ["Hello, world!", "  two  spaces\nand a line", "naïve café 🙂", "<|im_start|>user\nhi<|im_end|>", "<s>x</s>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour. <|im_end|>"},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]


def served_models(tiny_llama: Path) -> list[Path]:
    return [DEFAULT_MODEL, TINY_PAIR / "target", TINY_PAIR / "draft", tiny_llama]


def test_every_served_tokenizer_is_the_one_autotokenizer_loads(tiny_llama):
    for directory in served_models(tiny_llama):
        ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory, local_files_only=True)
        assert type(ours) is type(theirs), directory
        assert len(ours) == len(theirs) and ours.special_tokens_map == theirs.special_tokens_map, directory
        for text in TEXTS:
            for special in (True, False):
                assert ours(text, add_special_tokens=special)["input_ids"] == \
                    theirs(text, add_special_tokens=special)["input_ids"], (directory, text)
        if theirs.chat_template:
            assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
                theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), directory
        ids = list(range(len(theirs)))
        written = theirs.convert_ids_to_tokens(ids)
        slow_bound = max(max(len(d.encode()), len((w or "").encode()))
                         for d, w in zip(theirs.batch_decode([[i] for i in ids]), written))
        assert _longest_token_bytes(ours) == slow_bound, directory


def test_a_model_specific_tokenizer_class_still_loads_through_autotokenizer(tmp_path):
    directory = tmp_path / "gpt2_named"
    shutil.copytree(TINY_PAIR / "target", directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    expected = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert type(load_tokenizer(directory)) is type(expected)
    assert type(expected).__name__ != "TokenizersBackend"  # the case is a real one


def test_the_preprocessing_and_llm_processes_import_no_torch():
    """Their stubs import serving.triton.preprocessing and llm_bls; torch would cost each of them
    seconds of start-up and hundreds of MB. Outside Triton, a stand-in for Triton's utilities."""
    probe = (
        "import sys, types; sys.modules['triton_python_backend_utils'] = types.ModuleType('pb'); "
        "import serving.triton.preprocessing, serving.triton.llm_bls; "
        "from serving.triton.request_builder import Preprocessor; from pathlib import Path; "
        f"Preprocessor(Path({str(DEFAULT_MODEL)!r}), 2048); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:300]


def test_the_gateway_starts_without_torch_and_its_chat_template_is_autotokenizers():
    probe = (
        "import sys; import serving.gateway.server; "
        "from serving.gateway.chat_template import ChatTemplate; "
        f"t = ChatTemplate.load({str(DEFAULT_MODEL)!r}).tokenizer; print(type(t).__name__); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xgrammar')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [type(AutoTokenizer.from_pretrained(DEFAULT_MODEL)).__name__, "[]"], out.stdout


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:2]])
def test_the_preprocessor_renders_chat_as_autotokenizer_does(messages):
    preprocessor = Preprocessor(DEFAULT_MODEL, 2048)
    theirs = AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)
    assert preprocessor._render_chat(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
