"""The shipped configuration (model_repository/llm_engine/config.pbtxt) as the engine reads it:
its "auto" values become the fastest configuration of the device the engine runs on, and every
value a user sets is kept as set."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from backend.config import EngineConfig

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository" / "llm_engine"


def shipped() -> EngineConfig:
    """llm_engine's parameters as `make serve` ships them, read through EngineConfig.from_strings."""
    text = (REPOSITORY / "config.pbtxt").read_text()
    values = dict(re.findall(r'\{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}', text))
    values = {k: v for k, v in values.items() if k not in ("engine_process", "max_pending_requests")}
    for path in ("model", "draft_model"):
        values[path] = str(REPOSITORY / values[path])
    return EngineConfig.from_strings(values)


def test_a_cpu_gets_int4_weights_and_compiled_steps():
    config = shipped().for_device("cpu")
    assert (config.dtype, config.draft_dtype, config.quantization, config.quantization_group_size) == (
        "float32", "float32", "int4", 32)
    assert config.compile_decode is True and config.compile_prefill is True  # this machine has a C++ compiler
    assert config.speculative_method == "eagle"


def test_a_gpu_gets_bfloat16_and_no_compiled_cpu_steps():
    config = shipped().for_device("cuda")
    assert (config.dtype, config.draft_dtype, config.quantization) == ("bfloat16", "bfloat16", "none")
    assert config.compile_decode is False and config.compile_prefill is False


def test_without_a_cxx_compiler_the_steps_run_eagerly_and_the_log_says_so(monkeypatch, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level(logging.WARNING, logger="backend.config"):
        config = shipped().for_device("cpu")
    assert config.compile_decode is False and config.compile_prefill is False
    assert config.quantization == "int4"
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 2  # one line per parameter


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_what_a_user_sets_is_kept(device):
    base = shipped()
    values = {"dtype": "float16", "draft_dtype": "float32", "quantization": "int8", "compile_decode": False,
              "compile_prefill": True}
    config = EngineConfig(**{**{f: getattr(base, f) for f in base.__slots__}, **values}).for_device(device)
    assert {k: getattr(config, k) for k in values} == values


def test_auto_is_read_from_strings_and_anything_else_is_refused():
    config = EngineConfig.from_strings({"model": str(REPOSITORY / "1" / "target"), "compile_decode": "auto",
                                        "dtype": "auto", "quantization": "auto"})
    assert config.compile_decode is None and config.dtype == "auto" and config.draft_dtype == "auto"
    with pytest.raises(Exception, match="compile_prefill"):
        EngineConfig.from_strings({"model": str(REPOSITORY / "1" / "target"), "compile_prefill": "sometimes"})
    with pytest.raises(Exception, match="quantization"):
        EngineConfig.from_strings({"model": str(REPOSITORY / "1" / "target"), "quantization": "int3"})
