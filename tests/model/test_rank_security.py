"""The ranks' rendezvous takes no one who does not hold the ranks' secret: an impostor joining as
the missing rank of a two-node engine, with a wrong secret, a crafted pickle for a proof or none
at all, is refused by name and nothing it sends is run; on one node the ranks meet in a private
directory and gloo listens on loopback only."""
from __future__ import annotations

import datetime
import os
import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch.distributed as dist

from backend.config import EngineConfig
from backend.parallel.distributed import RANK_SECRET_VARIABLE, RankRefusedError, prove_secret
from backend.engine import LLMEngine
from backend.errors import FatalEngineError
from tests.conftest import free_port
from tests.model.test_pipeline_parallel import TEST_RANK_SECRET
from tests.unit.test_wire import crafted_pickle

WRONG_SECRET = "0bad" * 16


def impostor(port: int, marker: str, attack: str) -> None:
    """Join the engine at 127.0.0.1:`port` as rank 1 of 2, the way `attack` says; exit 3 when refused."""
    url = f"tcp://127.0.0.1:{port}"
    if attack == "unaware":  # a rank that knows no proof: the join, then a pickle where rank 0 once took one
        dist.init_process_group("gloo", init_method=url, rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=10))
        dist.gather_object(crafted_pickle(marker), None, dst=0)
        return
    store = next(dist.rendezvous(url, 1, 2, timeout=datetime.timedelta(seconds=30)))[0]
    store = dist.PrefixStore("specserve", store)
    if attack == "wrong secret":
        try:
            prove_secret(store, bytes.fromhex(WRONG_SECRET), 1, 2)
        except RankRefusedError as e:
            print(e, file=sys.stderr)
            raise SystemExit(3) from None
        return
    store.get("nonce")  # a crafted pickle for a proof
    store.set("proof/1", crafted_pickle(marker))
    print(f"rank 0 refused the join: {store.get('verdict').decode()}", file=sys.stderr)
    raise SystemExit(3)


@pytest.mark.parametrize("attack", ["wrong secret", "pickle for a proof", "unaware"])
def test_an_impostor_as_the_missing_rank_is_refused_and_nothing_it_sends_runs(attack, tiny_llama, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv(RANK_SECRET_VARIABLE, TEST_RANK_SECRET)
    monkeypatch.setattr("backend.parallel.distributed.PROOF_TIMEOUT", datetime.timedelta(seconds=3))
    marker, port = tmp_path / "marker", free_port()
    config = EngineConfig(model=str(tiny_llama), pipeline_parallel_size=2, nnodes=2, master_port=port)
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(LLMEngine, config)  # rank 0, waiting for rank 1
        code = f"from tests.model.test_rank_security import impostor; impostor({port}, {str(marker)!r}, {attack!r})"
        joining = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(FatalEngineError, match=f"rank 1 did not prove it holds the ranks' shared secret "
                                                       f"\\({RANK_SECRET_VARIABLE}\\)"):
                starting.result(timeout=120)
            if attack != "unaware":
                assert joining.wait(30) == 3  # told it is refused
                assert "rank 0 refused the join: rank 1 did not prove" in joining.stderr.read()
        finally:
            joining.kill()
            joining.wait()
    assert not marker.exists()
    assert not dist.is_initialized()  # rank 0 left nothing behind: the next engine can join
    assert port not in {address.port for address in _listening(psutil.Process())}  # nor its rendezvous open


def _listening(process: psutil.Process) -> list:
    return [c.laddr for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def _an_outside_interface() -> str | None:
    """A network interface with an IPv4 address other than loopback's, if this host has one."""
    return next((name for name, addresses in psutil.net_if_addrs().items() if any(
        a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses)), None)


def test_one_node_ranks_meet_in_a_private_directory_and_listen_on_loopback(tiny_llama, monkeypatch):
    outside = _an_outside_interface()
    if outside is not None:  # where gloo would listen if the engine left the interface to the environment
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outside)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2))
    group = engine.workers
    directory = group.directory
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert str(os.getpid()) not in os.path.basename(directory)
        worker = psutil.Process(group.workers[0].pid)
        secret = worker.environ()[RANK_SECRET_VARIABLE]  # fresh for this engine, in the environment
        assert len(bytes.fromhex(secret)) == 32 and secret not in " ".join(worker.cmdline())
        for rank in (psutil.Process(), worker):
            listening = {address.ip for address in _listening(rank)}
            assert listening and listening <= {"127.0.0.1", "::1"}
    finally:
        group.close()  # the ranks' process group goes too, whatever failed: the next engine can join
    assert not os.path.exists(directory)
    assert os.environ.get("GLOO_SOCKET_IFNAME") == outside  # set back for whatever this process does next
