"""Simulated engines and episodes at reference scale, for bench/overlap.py and tests.

Timing model (seconds of simulated time; run it on services/testing/virtual_clock.py):
an episode creates a sandbox, runs a long-tailed number of turns (each turn generates a
log-normal number of tokens on its sticky engine, then runs a command of log-normal
duration), then verifies. An engine decodes each request at `tokens_per_s / (1 + active /
batch_knee)`, so a busier engine is slower per request, and stops decoding while paused (as
during a weight update). Each turn contributes two response tokens standing for its first
and last generated token, carrying the weight version the engine held at that moment.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from services._proto.riptide.v1 import common_pb2, sandbox_pb2


@dataclass
class EpisodeShape:
    """Distribution parameters of one simulated episode."""

    sandbox_create_s: float = 20.0
    verify_s: float = 10.0
    turns_median: float = 8.0
    turns_sigma: float = 0.7
    max_turns: int = 30
    tokens_median: float = 250.0
    tokens_sigma: float = 0.8
    max_tokens: int = 8192
    exec_median_s: float = 3.0
    exec_sigma: float = 1.0
    max_exec_s: float = 900.0
    no_verdict_rate: float = 0.0


class VirtualEngine:
    """An engine that decodes at a load-dependent rate and can be paused."""

    def __init__(self, name: str, tokens_per_s: float = 60.0, batch_knee: float = 32.0) -> None:
        self.name = name
        self.tokens_per_s = tokens_per_s
        self.batch_knee = batch_knee
        self.weight_version = 0
        self.active = 0
        self.sessions = 0
        self._running = asyncio.Event()
        self._running.set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def generate(self, num_tokens: int, chunk_s: float = 2.0) -> tuple[int, int]:
        """Decode `num_tokens`; the weight versions held at the first and last token."""
        await self._running.wait()
        first = self.weight_version
        self.active += 1
        try:
            remaining = float(num_tokens)
            while remaining > 0:
                await self._running.wait()
                rate = self.tokens_per_s / (1.0 + self.active / self.batch_knee)
                step = min(remaining, rate * chunk_s)
                await asyncio.sleep(step / rate)
                remaining -= step
        finally:
            self.active -= 1
        return first, self.weight_version


class SimEpisodeRunner:
    """An EpisodeRunner whose episodes run against VirtualEngines (sticky, least sessions first)."""

    def __init__(self, engines: list[VirtualEngine], shape: EpisodeShape | None = None,
                 seed: int = 0) -> None:
        self.engines = engines
        self.shape = shape or EpisodeShape()
        self._rng = random.Random(seed)

    def _lognormal(self, median: float, sigma: float, cap: float) -> float:
        return min(cap, median * math.exp(self._rng.gauss(0.0, sigma)))

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
        shape = self.shape
        engine = min(self.engines, key=lambda e: e.sessions)
        engine.sessions += 1
        turns = max(1, round(self._lognormal(shape.turns_median, shape.turns_sigma,
                                             shape.max_turns)))
        plan = [(int(self._lognormal(shape.tokens_median, shape.tokens_sigma, shape.max_tokens)),
                 self._lognormal(shape.exec_median_s, shape.exec_sigma, shape.max_exec_s))
                for _ in range(turns)]
        no_verdict = self._rng.random() < shape.no_verdict_rate
        reward = float(self._rng.random() < 0.5)
        versions: list[int] = []
        try:
            await asyncio.sleep(shape.sandbox_create_s)
            for num_tokens, exec_s in plan:
                first, last = await engine.generate(max(1, num_tokens))
                versions += [first, last]
                await asyncio.sleep(exec_s)
            await asyncio.sleep(shape.verify_s)
        finally:
            engine.sessions -= 1
        status = (common_pb2.VERDICT_STATUS_NO_VERDICT if no_verdict
                  else common_pb2.VERDICT_STATUS_SCORED)
        return common_pb2.Trajectory(
            prompt_ids=[0], response_ids=[1] * len(versions), loss_mask=[1] * len(versions),
            rollout_logprobs=[-1.0] * len(versions), weight_versions=versions, reward=reward,
            status=status, num_turns=turns, finish_reason="complete")
