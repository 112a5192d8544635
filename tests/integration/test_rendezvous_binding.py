"""The trainer's two torch rendezvous stores (its process group and the weight-update group)
listen on the configured address only, not on every interface: checked in /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from services.common.ports import free_ports
from services.testing.listeners import listening_sockets

RANK = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from services.common import weight_group
from services.trainer.model_config import ParallelConfig
from services.trainer.parallel.parallel import init_parallel

rank, pg_port, wg_port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
init_parallel(ParallelConfig(backend="gloo"), rank=rank, world_size=2,
              master_addr="127.0.0.1", master_port=pg_port)
group = weight_group.init_custom_process_group(
    backend="gloo", init_method=f"tcp://127.0.0.1:{wg_port}", world_size=2, rank=rank,
    group_name="bind-test", timeout_s=60)
print("joined", flush=True)
dist.barrier()
sys.stdin.read()  # hold the stores open until the test has looked
"""


@pytest.mark.slow
def test_rendezvous_stores_bind_the_configured_address() -> None:
    pg_port, wg_port = free_ports(2)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(pg_port), str(wg_port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        for proc in ranks:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "joined"
        deadline = time.monotonic() + 10
        listening = listening_sockets(ranks[0].pid)
        while {pg_port, wg_port} - {port for _, port in listening}:
            assert time.monotonic() < deadline, listening
            listening = listening_sockets(ranks[0].pid)
        stores = [(addr, port) for addr, port in listening if port in (pg_port, wg_port)]
        assert sorted(stores) == sorted([("127.0.0.1", pg_port), ("127.0.0.1", wg_port)])
        everywhere = [s for s in listening if s[0] in ("0.0.0.0", "::")]
        assert everywhere == [], f"rank 0 listens on every interface: {everywhere}"
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
