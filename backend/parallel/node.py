"""Another node's share of a parallel engine: its worker ranks, which join rank 0 (the engine on
the first node, inside tritonserver) at a rendezvous given by torchrun's environment variables.

    MASTER_ADDR=<first node> MASTER_PORT=<port> WORLD_SIZE=<tp x pp> LOCAL_WORLD_SIZE=<ranks here> \\
        NODE_RANK=<1..> SPECSERVE_RANK_SECRET=<hex> python -m backend.parallel.node

Node n runs ranks [n * LOCAL_WORLD_SIZE, (n + 1) * LOCAL_WORLD_SIZE): with LOCAL_WORLD_SIZE =
tensor_parallel_size, one whole pipeline stage. The engine's config (model path included: the
checkpoint must be at the same path here) comes from rank 0. SPECSERVE_RANK_SECRET is the secret
every rank proves it holds when it joins: the same on every node, tritonserver's included (e.g.
`python -c 'import secrets; print(secrets.token_hex(32))'`). The node exits when its ranks do:
when the engine stops them, or when a peer is gone; if one of its ranks fails, it stops the
others. Killing this command kills its ranks.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from backend.parallel.distributed import rank_secret_from_env
from backend.parallel.worker_group import start_worker

VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


def main() -> int:
    if len(sys.argv) > 1:
        print(__doc__)
        return 0 if sys.argv[1] in ("-h", "--help") else 2
    missing = [name for name in VARIABLES if not os.environ.get(name)]
    if missing:
        print(f"specserve node: set {', '.join(missing)} (see `python -m backend.parallel.node --help`)", file=sys.stderr)
        return 2
    env = {name: os.environ[name] for name in VARIABLES}
    world_size, local, node = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]), int(env["NODE_RANK"])
    if not 0 < node < world_size // local:
        print(f"specserve node: NODE_RANK must be in [1, {world_size // local}) (node 0 runs tritonserver)",
              file=sys.stderr)
        return 2
    try:
        rank_secret_from_env()  # the workers read it from the environment they inherit
    except ValueError as e:
        print(f"specserve node: {e}", file=sys.stderr)
        return 2
    init_method = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    ranks = range(node * local, (node + 1) * local)
    workers = [start_worker(rank, world_size, init_method, os.getpid()) for rank in ranks]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while True:  # until every rank is done, or one has failed
            codes = [w.poll() for w in workers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            worker.wait()


if __name__ == "__main__":
    raise SystemExit(main())
