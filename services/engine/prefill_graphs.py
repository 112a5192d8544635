"""CUDA graphs of short prefills: an agent's later turns, a few rows of tens of new tokens over
a cached prefix, arrive every few decode steps, and an eager prefill of them costs the host
about 30 ms of kernel launches for a few ms of GPU work (`bench/engine_prefill.py`). Padded
to a bucket of (rows, tokens per row, KV width), such a prefill is one graph replay.

The graph computes the final hidden state of each row's last real token only (the logits
head runs after it, outside the graph, so no graph holds a vocabulary-wide output). Padding
rows and padding tokens write their keys and values to the sink slot, as the eager prefill's
padding does. A prefill that does not fit a bucket (more rows or tokens, or one asking for every
position's logits) runs eagerly. Graphs are captured on first use and share one memory pool.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.engine.decode_graphs import width_bucket
from services.engine.slot_model import PrefillRow, SlotModel

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16)
TOKEN_BUCKETS = (16, 32, 64, 128, 256)


def bucket(need: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= need), None)


class PrefillGraphs:
    """Runs short prefills of one SlotModel padded to buckets: replayed graphs on CUDA, the
    same padded forward eagerly elsewhere (how its padding is tested without a GPU)."""

    def __init__(self, model: SlotModel, use_graphs: bool) -> None:
        self.model = model
        self.use_graphs = use_graphs
        most = ROW_BUCKETS[-1] * TOKEN_BUCKETS[-1]
        device = model.cos.device
        # ids, positions, write slots, write columns ([rows, tokens] as a flat prefix), then
        # per row its read slot and its last real token's index
        self.tokens = torch.zeros((4, most), dtype=torch.long, device=device)
        self.rows = torch.zeros((2, ROW_BUCKETS[-1]), dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self.failed: set[tuple[int, int, int]] = set()  # buckets whose capture failed: eager

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph and their pool (the weights or KV storage they read will move)."""
        self._graphs.clear()
        self._pool = None

    def key(self, rows: list[PrefillRow]) -> tuple[int, int, int] | None:
        """The (rows, tokens, width) bucket of a prefill, or None when it must run eagerly."""
        if any(row.all_logits for row in rows):
            return None
        r = bucket(len(rows), ROW_BUCKETS)
        n = bucket(max(len(row.tokens) for row in rows), TOKEN_BUCKETS)
        if r is None or n is None:
            return None
        width = width_bucket(max(row.start + len(row.tokens) for row in rows),
                             self.model.kv.slot_len)
        key = (r, n, width)
        return None if key in self.failed else key

    @torch.inference_mode()
    def prefill(self, rows: list[PrefillRow], key: tuple[int, int, int]) -> list[torch.Tensor]:
        """Each row's last-token logits [1, V], as `SlotModel.prefill` returns them."""
        r, n, width = key
        self._stage(rows, r, n)
        if self.use_graphs:
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._capture(key)
                if entry is None:
                    return self.model.prefill(rows)
            entry[0].replay()
            hidden = entry[1]
        else:
            hidden = self._forward(r, n, width)
        logits = self.model.logits(hidden[: len(rows)])
        return list(logits.split(1))

    def _stage(self, rows: list[PrefillRow], r: int, n: int) -> None:
        sink, last_position = self.model.kv.sink, self.model.kv.slot_len - 1
        offsets = torch.arange(n)
        ids = torch.zeros((r, n), dtype=torch.long)
        positions = offsets.repeat(r, 1)
        slots = torch.full((r, n), sink, dtype=torch.long)
        columns = offsets.repeat(r, 1)  # padding: the sink's columns 0..n-1
        read = torch.full((r,), sink, dtype=torch.long)
        last = torch.zeros(r, dtype=torch.long)
        for i, row in enumerate(rows):
            m = len(row.tokens)
            ids[i, :m] = torch.tensor(row.tokens)
            positions[i] = (row.start + offsets).clamp(max=last_position)
            slots[i, :m] = row.slot
            columns[i, :m] = positions[i, :m]
            read[i], last[i] = row.slot, m - 1
        staged = torch.stack([ids, positions, slots, columns]).view(4, r * n)
        self.tokens[:, : r * n].copy_(staged, non_blocking=True)
        self.rows[:, :r].copy_(torch.stack([read, last]), non_blocking=True)

    def _forward(self, r: int, n: int, width: int) -> torch.Tensor:
        """Hidden states [r, hidden] of each row's last real token, from the static inputs."""
        ids, positions, slots, columns = (t.view(r, n) for t in self.tokens[:, : r * n])
        read, last = self.rows[0, :r], self.rows[1, :r]
        hidden = self.model.forward(ids, positions, (slots, columns), read, width)
        return hidden[torch.arange(r, device=hidden.device), last]

    def _capture(self, key: tuple[int, int, int]
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        # The warm-up runs on the live inputs (a side stream, as capture needs): it writes the
        # keys and values the replay will write again, so it is harmless.
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*key)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self._forward(*key)
        except RuntimeError as error:  # a kernel that cannot be captured: this bucket stays eager
            log.warning("prefill graph %s not captured (%s); it runs eagerly", key, error)
            self.failed.add(key)
            return None
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = (graph, hidden)
        return graph, hidden
