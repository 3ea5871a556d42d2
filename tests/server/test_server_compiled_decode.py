"""The shipped configuration through a real tritonserver: with llm_engine's "auto" values on a CPU
the engine loads int4 weights and compiles its decode and prefill graphs inside the python backend,
saying so in the server's log, and `llm` over it streams the same greedy text as `llm_eager`, an
engine of the same int4 model without compiled steps, for concurrent requests (prefills together,
decode batches of several) and one alone."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from client.stream import complete

pytestmark = pytest.mark.server

PROMPTS = ["Once upon a time, a little robot", "def main():", "The capital of", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def compiled_server(tmp_path_factory):
    from tests.server.conftest import start_test_server

    shipped = {"dtype": "auto", "quantization": "auto", "compile_decode": "auto", "compile_prefill": "auto"}
    server = start_test_server(tmp_path_factory.mktemp("compiled"), "", parameters=shipped,
                               variants={"eager": {"compile_decode": "false", "compile_prefill": "false"}})
    yield server
    server.handle.stop()


def _texts(server, model: str) -> list[str]:
    params = dict(max_tokens=32, temperature=0.0, ignore_eos=True, model=model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(server.grpc_url, p, protocol="grpc", stream=True,
                                                    **params).text, PROMPTS))
    alone = complete(server.grpc_url, PROMPTS[0], protocol="grpc", stream=True, **params).text
    return together + [alone]


def test_compiled_decode_streams_the_eager_engines_text(compiled_server):
    log = compiled_server.handle.log_path.read_text()
    for step in ("compile_decode: compiling the decode step", "compile_prefill: the prefill step compiled in"):
        assert step in log
    assert "quantization='int4'" in log and "compile_decode=True" in log
    compiled = _texts(compiled_server, "llm")
    assert all(compiled)
    assert compiled == _texts(compiled_server, "llm_eager")
    assert compiled[0] == compiled[-1]  # alone as in a batch
