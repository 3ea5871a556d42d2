"""Pipeline parallelism across two "nodes" on loopback: tritonserver's llm_engine holds stage 0
and the rendezvous, `python -m backend.parallel.node` started on its own with torchrun's variables holds
stage 1, both with the ranks' secret. Streams equal one rank's; killing the node ends them with
the engine's error within seconds, llm_engine unloads itself and the server lives on."""
from __future__ import annotations

import pytest

from backend.parallel.distributed import RANK_SECRET_VARIABLE
from tests.conftest import free_port
from tests.model.test_pipeline_parallel import TEST_RANK_SECRET, start_node
from tests.server.conftest import start_test_server, wait_until_unloaded
from tests.server.test_server_engine_process import PROMPTS, _kill_mid_stream, _texts

pytestmark = pytest.mark.server


def test_a_second_node_serves_stage_1_and_its_death_ends_the_streams(tmp_path, server, monkeypatch):
    monkeypatch.setenv(RANK_SECRET_VARIABLE, TEST_RANK_SECRET)  # tritonserver's, as the node's
    port = free_port()
    node = start_node(port, world_size=2, local_world_size=1, node_rank=1)
    try:
        pp = start_test_server(tmp_path, "", {"pipeline_parallel_size": "2", "nnodes": "2",
                                              "master_port": str(port)})
        try:
            prompts = PROMPTS * 2  # 16 concurrent streams, in two batches in flight
            assert _texts(pp, prompts) == _texts(server, prompts)
            _kill_mid_stream(pp, node)
            wait_until_unloaded(pp, "llm_engine")
            assert pp.handle.process.poll() is None  # the server lives on
            assert node.wait(10) != 0
        finally:
            pp.handle.stop()
    finally:
        node.kill()
        node.wait()
