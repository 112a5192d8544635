"""The live-tunable concurrency cap."""

from __future__ import annotations

import asyncio

from services.sandbox.limiter import Limiter


def test_cap_holds_and_follows_live_changes() -> None:
    async def run() -> list[int]:
        limiter = Limiter(2)
        peaks: list[int] = []
        release = asyncio.Event()

        async def worker() -> None:
            async with limiter:
                peaks.append(limiter.in_use)
                await release.wait()

        workers = [asyncio.create_task(worker()) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert (limiter.in_use, limiter.waiting) == (2, 3)
        limiter.set_limit(4)  # raising lets waiters in at once
        await asyncio.sleep(0.05)
        assert (limiter.in_use, limiter.waiting) == (4, 1)
        limiter.set_limit(1)  # lowering never interrupts holders
        release.set()
        await asyncio.gather(*workers)
        assert limiter.in_use == 0
        release.clear()
        cancelled = asyncio.create_task(worker())
        await asyncio.sleep(0.01)
        assert limiter.in_use == 1
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert limiter.in_use == 0, "a cancelled holder gives its slot back"
        return peaks

    assert max(asyncio.run(run())) <= 4
