"""Run a function as N torch.distributed ranks in N processes (gloo on loopback).

`run_ranks(path, "fn", world_size, kwargs)` starts one process per rank; each imports the
Python file at `path`, calls `fn(rank=..., world_size=..., master_port=..., **kwargs)` and
writes its JSON-able return value back. Used by tests of the trainer's TP/PP/DP code paths.
Processes are started in their own session and stopped by process group.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.common.ports import free_port
from services.common.process import spawn, stop


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the ranks ran past their time limit."""


def run_ranks(
    path: str | Path,
    function: str,
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 180.0,
) -> list[Any]:
    """Run `function` from the file `path` on `world_size` ranks; returns each rank's result."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out = Path(tmp)
        args = json.dumps(kwargs or {})
        procs = [
            spawn(
                [sys.executable, "-m", "services.testing.trainer_ranks", str(path), function,
                 str(rank), str(world_size), str(port), args, str(out / f"{rank}.json")],
                log_path=out / f"{rank}.log",
            )
            for rank in range(world_size)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
        finally:
            codes = [p.poll() for p in procs]
            for p in procs:
                stop(p, grace_s=2.0)
        if codes != [0] * world_size:
            logs = "\n".join(
                f"--- rank {r} (exit {codes[r]}) ---\n"
                + (out / f"{r}.log").read_text(errors="replace")[-4000:]
                for r in range(world_size)
            )
            raise RanksFailed(f"{function} on {world_size} ranks failed:\n{logs}")
        return [json.loads((out / f"{r}.json").read_text()) for r in range(world_size)]


def _main(argv: list[str]) -> None:
    path, function, rank, world_size, port, args, out = argv
    spec = importlib.util.spec_from_file_location("_ranks_target", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, function)(
        rank=int(rank), world_size=int(world_size), master_port=int(port), **json.loads(args)
    )
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1:])
