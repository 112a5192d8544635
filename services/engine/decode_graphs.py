"""CUDA graphs of the slots decode step: one per (batch bucket, KV width bucket), captured on
first use and replayed after, so a decode step costs one graph launch instead of the few
hundred kernel launches (and their Python) of an eager forward.

Inputs live in static tensors the graphs read: token ids, positions and slots, padded up to
the bucket with rows that write to the sink slot. The width bucket bounds the columns
attention reads, so short sequences do not pay for the slot's full length. All graphs share
one memory pool; each step's logits are read before the next replay reuses it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.engine.slot_model import SlotModel

MIN_WIDTH = 128


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes up to `max_batch`: 1, 2, 4, 8, then steps of 8, 16 and 32."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size = size * 2 if size < 8 else size + (8 if size < 64 else 16 if size < 256 else 32)
    return [*sizes, max_batch]


def width_bucket(need: int, slot_len: int) -> int:
    """The smallest width of the form 128·2^k or 192·2^k holding `need` columns (<= slot_len)."""
    width = MIN_WIDTH
    while width < need:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return min(width, slot_len)


class DecodeGraphs:
    """Captures and replays the decode step of one SlotModel."""

    def __init__(self, model: SlotModel, max_batch: int) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch)
        device = model.cos.device
        self.inputs = torch.zeros((3, max_batch), dtype=torch.long, device=device)
        self.inputs[2] = model.kv.sink  # until a step writes real rows
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the first graph's memory pool, shared by the others

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph and their memory pool: the buffers they read are about to move."""
        self._graphs.clear()
        self._pool = None

    def capture_all(self) -> float:
        """Capture every (batch, width) bucket now, so no step pays a capture; returns seconds.

        Capturing writes only into the sink slot (the static inputs point there)."""
        started = time.perf_counter()
        widths = sorted({width_bucket(n, self.model.kv.slot_len)
                         for n in range(1, self.model.kv.slot_len + 1)})
        for size in self.buckets:
            for width in widths:
                if (size, width) not in self._graphs:
                    self._capture(size, width)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def run(self, ids: list[int], positions: list[int], slots: list[int], width: int
            ) -> torch.Tensor:
        """Logits [len(ids), V] of one decode step (replaying, capturing first if new)."""
        n = len(ids)
        size = next(b for b in self.buckets if b >= n)
        pad = size - n
        staged = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [self.model.kv.sink] * pad]
        )
        self.inputs[:, :size].copy_(staged, non_blocking=True)
        key = (size, width)
        entry = self._graphs.get(key) or self._capture(size, width)
        entry[0].replay()
        return entry[1][:n]

    @torch.inference_mode()
    def _capture(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions, slots = self.inputs[0, :size], self.inputs[1, :size], self.inputs[2, :size]
        # A warm-up outside the graph (on a side stream, as capture needs) writes the same
        # keys and values the replay will write, so running it on live inputs is harmless.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model.decode(ids, positions, slots, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.decode(ids, positions, slots, width)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(size, width)] = (graph, logits)
        return graph, logits
