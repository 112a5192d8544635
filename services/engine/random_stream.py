"""A request's own stream of uniform random numbers, drawn from its seeded generator in blocks.

Sampling takes one uniform number per request per token. Drawing it with a separate
`torch.rand` call costs microseconds per request and step, which at a hundred requests is a
good part of a GPU decode step; a block of draws then a list pop costs almost nothing. The
stream depends only on the seed, so a seeded request samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import torch

BLOCK = 256


class RandomStream:
    """Uniform numbers in [0, 1) from one seed."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._block: list[float] = []

    def next_uniform(self) -> float:
        if not self._block:
            drawn = torch.rand(BLOCK, generator=self._generator, dtype=torch.float64)
            self._block = drawn.tolist()[::-1]
        return self._block.pop()
