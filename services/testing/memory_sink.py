"""An in-memory group sink with the sample buffer's semantics, for tests and simulations.

Idempotent by group id, FIFO, bounded (put waits while full), and a consumer side that takes
a batch of groups in order.
"""

from __future__ import annotations

import asyncio
from collections import deque

from services._proto.riptide.v1 import common_pb2


class MemorySink:
    """A bounded FIFO of groups; `put` waits while `capacity` groups are unconsumed."""

    def __init__(self, capacity: int = 1 << 30) -> None:
        self.capacity = capacity
        self.groups: deque[common_pb2.Group] = deque()
        self.seen: set[str] = set()
        self.puts = 0
        self._changed = asyncio.Condition()

    async def put(self, group: common_pb2.Group) -> bool:
        """Append `group` unless its id was already written; False for a duplicate."""
        self.puts += 1
        async with self._changed:
            if group.group_id in self.seen:
                return False
            await self._changed.wait_for(lambda: len(self.groups) < self.capacity)
            self.seen.add(group.group_id)
            self.groups.append(group)
            self._changed.notify_all()
            return True

    async def take(self, num_groups: int) -> list[common_pb2.Group]:
        """Wait for `num_groups` groups and remove them, oldest first."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.groups) >= num_groups)
            batch = [self.groups.popleft() for _ in range(num_groups)]
            self._changed.notify_all()
            return batch

    def __len__(self) -> int:
        return len(self.groups)
