"""A concurrency cap whose limit can change while it is in use (live tuning)."""

from __future__ import annotations

import asyncio
from types import TracebackType


class Limiter:
    """Like an asyncio.Semaphore, but `limit` may be raised or lowered at any time.

    Lowering it never interrupts holders; new entrants wait until the count drops below it.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._limit = limit
        self._in_use = 0
        self._waiting = 0
        self._changed = asyncio.Condition()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return self._waiting

    def set_limit(self, limit: int) -> None:
        """Change the cap; waiters re-check it at once."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._limit = limit
        asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def acquire(self) -> None:
        async with self._changed:
            self._waiting += 1
            try:
                await self._changed.wait_for(lambda: self._in_use < self._limit)
            finally:
                self._waiting -= 1
            self._in_use += 1

    async def release(self) -> None:
        async with self._changed:
            self._in_use -= 1
            self._changed.notify_all()

    async def __aenter__(self) -> Limiter:
        await self.acquire()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        # Shielded so that a cancelled holder still gives its slot back.
        await asyncio.shield(self.release())
