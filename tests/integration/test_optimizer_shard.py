"""Optimizer state split over two data-parallel replicas (gloo): each replica keeps about half
of the master weights and moments (in memory or in disk-streamed files), yet after several
steps both hold parameters bit-identical to an unsharded optimizer fed the same gradients,
and a checkpointed shard restores to the same next step."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def shard_worker(rank: int, world_size: int, master_port: int, disk: bool) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from services.trainer.optim.optimizer_shard import state_shard
    from services.trainer.optim.optimizer_stream import MasterAdam

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))  # fmt: skip

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 8))  # fmt: skip

    def grads(step: int, params: list[torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(100 + step)  # the same "all-reduced" grads everywhere
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)

    tmp = Path(tempfile.mkdtemp(prefix=f"shard-{rank}-"))
    sharded, full = model(), model()
    kwargs: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "bucket_mb": 1e-3}
    opt = MasterAdam(list(sharded.parameters()), shard=state_shard(dist.group.WORLD),
                     state_dir=tmp / "state" if disk else None, **kwargs)  # fmt: skip
    ref = MasterAdam(list(full.parameters()), **kwargs)
    for step in range(3):
        for o, m in ((opt, sharded), (ref, full)):
            grads(step, list(m.parameters()))
            o.step()
            o.zero_grad()
        if step == 1:
            (tmp / "ckpt").mkdir()
            opt.save(tmp / "ckpt")
            saved = [p.detach().clone() for p in sharded.parameters()]
    after = [p.detach().clone() for p in sharded.parameters()]
    identical = all(torch.equal(a, b) for a, b in zip(after, full.parameters(), strict=True))
    # Restore step 2's state and redo step 3: the same parameters again.
    with torch.no_grad():
        for p, s in zip(sharded.parameters(), saved, strict=True):
            p.copy_(s)
    opt.load(tmp / "ckpt")
    grads(2, list(sharded.parameters()))
    opt.step()
    redo = all(torch.equal(a, p) for a, p in zip(after, sharded.parameters(), strict=True))
    dist.destroy_process_group()
    return {"identical": identical, "redo": redo, "state": opt.state_nbytes(),
            "full_state": ref.state_nbytes(), "owned": [b.index for b in opt.owned]}


@pytest.mark.parametrize("disk", [False, True])
def test_two_replicas_split_the_state_and_match_unsharded_adam(disk: bool) -> None:
    results = run_ranks(Path(__file__), "shard_worker", 2, {"disk": disk})
    for r in results:
        assert r["identical"] and r["redo"], r
        assert r["state"] <= 0.6 * r["full_state"], r  # about half of the state on each
    assert set(results[0]["owned"]).isdisjoint(results[1]["owned"])
    assert results[0]["state"] + results[1]["state"] == results[0]["full_state"]
