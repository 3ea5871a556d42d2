"""The preprocessor's tokenizer is local: a mistyped directory fails at once with an error that
names it, and neither a bad nor a good path ever opens a connection to the Hugging Face hub."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from serving.triton.request_builder import Preprocessor


@pytest.fixture
def no_network(monkeypatch):
    """Online mode (HF_HUB_OFFLINE unset), but any name lookup or connection fails the test."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def lookup(host, *args, **kwargs):
        pytest.fail(f"the preprocessor looked up {host}")

    def connect(sock, address):
        pytest.fail(f"the preprocessor opened a connection to {address}")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)


def test_a_mistyped_tokenizer_parameter_names_the_path(tmp_path, no_network):
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="llm_engine/1/targte") as error:
        Preprocessor.from_parameters({"tokenizer": "llm_engine/1/targte"}, tmp_path)
    assert str(tmp_path / "llm_engine/1/targte") in str(error.value)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/nonexistent/tokenizer"])
def test_a_hub_name_is_not_downloaded(name, tmp_path, monkeypatch, no_network):
    monkeypatch.chdir(tmp_path)  # the relative name resolves to nothing here
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=name):
        Preprocessor(Path(name), max_model_len=512)
    assert time.monotonic() - start < 5.0


def test_a_local_tokenizer_loads_offline(tiny_llama, no_network):
    preprocessor = Preprocessor.from_parameters({"tokenizer": tiny_llama.name}, tiny_llama.parent)
    assert preprocessor.tokenizer_dir == tiny_llama
    assert preprocessor.max_model_len == 512  # write_tiny_model's max_position_embeddings
    # conftest's byte tokenizer: "!" is id 3, the bytes follow in order, no BOS is added
    assert preprocessor.tokenizer("ab")["input_ids"] == [3 + ord("a") - ord("!"), 3 + ord("b") - ord("!")]
