"""A process that makes labelled local sandboxes, says `ready`, and waits to be killed: the
orphans a crashed sandbox service leaves, for tests of the reaper.

`python -m services.testing.orphan_maker ROOT_DIR TASKS_DIR TASK COUNT RUN INSTANCE INCARNATION`
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from services.sandbox.leases import Leases, Owner
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import TaskSet


async def make(root: Path, tasks_dir: Path, task_name: str, count: int, owner: Owner) -> None:
    provider = LocalProvider(LocalProviderConfig(root_dir=root))
    task = TaskSet.load(tasks_dir).get(task_name)
    leases = Leases(provider, owner)
    for i in range(count):
        await provider.create(task, labels=leases.labels(task.name, f"orphan-{i}"))


def main() -> None:
    root, tasks_dir, task, count, run, instance, incarnation = sys.argv[1:8]
    asyncio.run(make(Path(root), Path(tasks_dir), task, int(count),
                     Owner(run, instance, incarnation)))
    print("ready", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
