"""Preallocated KV storage: one fixed slot per running request, allocated once at start.

Per layer, keys and values are [num_slots + 1, kv_heads, slot_len, head_dim]. A request owns
one slot from prefill to finish, so decode writes each new token's keys and values in place
and nothing is ever concatenated, padded or copied between rows. The extra last slot is a
sink: padded rows of a batch bucket and padding tokens of a prefill write there, so their
writes never touch a real request's slot. Storage starts zeroed (masked-out columns must hold
finite numbers: attention multiplies them by zero weights). On CPU it is an anonymous memory
mapping, zero pages until first written, so only the columns requests reach take memory.
"""

from __future__ import annotations

import heapq
import math
import mmap

import torch

from services.common.errors import Unavailable
from services.engine.radix_cache import KV, kv_len


class SlotKV:
    """The KV slots of one dp rank and the free list that hands them out."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        slot_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._spec = ((num_layers, 2, num_slots + 1, kv_heads, slot_len, head_dim), dtype, device)
        self.storage: torch.Tensor | None = None  # [layers, 2 (key, value), slots + 1, H, L, D]
        self.keys: list[torch.Tensor] = []  # per layer [slots + 1, H, L, D], views of storage
        self.values: list[torch.Tensor] = []
        self.allocate_storage()
        self.num_slots = num_slots
        self.slot_len = slot_len
        self.sink = num_slots
        self.stacked_rows = device.type != "cpu"
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first

    def allocate_storage(self) -> None:
        """(Re)allocate every layer's storage, zeroed; after `free_storage` the tensors are new
        (other addresses: CUDA graphs captured on the old ones must be captured again)."""
        shape, dtype, device = self._spec
        self.storage = _zeros(shape, dtype, device)
        self.keys = [layer[0] for layer in self.storage]
        self.values = [layer[1] for layer in self.storage]

    def free_storage(self) -> None:
        """Drop every layer's storage (colocated mode: the trainer uses the memory); every slot
        must be free."""
        if len(self._free) != self.num_slots:
            raise ValueError("KV storage freed while slots are in use")
        self.storage, self.keys, self.values = None, [], []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def allocate(self) -> int:
        if not self._free:
            raise Unavailable(f"all {self.num_slots} KV slots are in use")
        # The lowest first keeps the slots in use dense, which lets CPU decode read them as one
        # view (slot_batch.py).
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        heapq.heappush(self._free, slot)

    def write(self, slot: int, kv: KV) -> None:
        """Copy a cached prefix of n tokens (stacked [layers, 2, H, n, D] in one copy, or per
        layer [H, n, D]) into the first n columns of `slot`."""
        n = kv_len(kv)
        if isinstance(kv, torch.Tensor):
            assert self.storage is not None, "KV storage is released"
            self.storage[:, :, slot, :, :n] = kv
            return
        for keys, values, (k, v) in zip(self.keys, self.values, kv, strict=True):
            keys[slot, :, :n] = k
            values[slot, :, :n] = v

    def row(self, slot: int, length: int) -> KV:
        """The first `length` tokens of `slot` (views): on a GPU stacked [layers, 2, H, length,
        D], so the prefix cache copies it in one kernel instead of one per layer and per key
        and value (12x less per request on an H200); on the CPU per layer [H, length, D], where
        the copies are not launch-bound and the stacked ones were slower in float32
        (bench/engine_cache_ops.py, docs/engine-cuda.md)."""
        assert self.storage is not None, "KV storage is released"
        if self.stacked_rows:
            return self.storage[:, :, slot, :, :length]
        return [(k[slot, :, :length], v[slot, :, :length])
                for k, v in zip(self.keys, self.values, strict=True)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive; the kernel hands out zeroed pages on first touch.
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
