"""A KV cache layer that grows in place: decode writes one column into spare capacity.

transformers' DynamicLayer concatenates the whole cache with each new token, so every decode
step copies every layer's KV (half the step time of a 135M model on CPU at 1,000 tokens).
This layer keeps preallocated storage and exposes the filled part as a view; it reallocates,
with room for `spare` more columns, only when the storage is full.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_SPARE_COLUMNS = 256


class GrowingLayer(DynamicLayer):
    """Keys and values [B, H, n, D] as views of storage [B, H, capacity, D]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        super().__init__()
        self.spare = max(1, spare)
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self._length = 0
        self._key_store = keys.new_empty(0)
        self._value_store = values.new_empty(0)
        self._write(keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._write(key_states, value_states)

    def _write(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + keys.shape[2]
        if self._key_store.dim() != 4 or end > self._key_store.shape[2]:
            self._grow(keys, end + self.spare)
        self._key_store[:, :, start:end] = keys
        self._value_store[:, :, start:end] = values
        self._length = end
        filled_keys, filled_values = self._key_store[:, :, :end], self._value_store[:, :, :end]
        self.keys, self.values = filled_keys, filled_values
        return filled_keys, filled_values

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = like.shape
        key_store = like.new_empty(batch, heads, capacity, dim)
        value_store = like.new_empty(batch, heads, capacity, dim)
        if self._length:
            key_store[:, :, : self._length] = self._key_store[:, :, : self._length]
            value_store[:, :, : self._length] = self._value_store[:, :, : self._length]
        self._key_store, self._value_store = key_store, value_store


def growing_cache(
    layers: list[tuple[torch.Tensor, torch.Tensor]], spare: int = DEFAULT_SPARE_COLUMNS
) -> DynamicCache:
    """A DynamicCache over `layers` ([B, H, n, D] each) whose decode writes in place."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(keys, values, spare) for keys, values in layers]
    return cache
