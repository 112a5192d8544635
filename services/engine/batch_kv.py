"""The KV cache of a running batch: one transformers DynamicCache, rows left-padded.

Row i's tokens are the last `lengths[i]` columns; the attention mask hides the padding and
position ids come from the lengths, so rows of any length decode together in one forward.
Rows join (after their own prefill) and leave between steps. Decode appends into spare
capacity in place (`kv_storage`); joining or leaving rows copies the batch once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from services.engine.kv_storage import growing_cache
from services.engine.radix_cache import LayerKV


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) tensors of every layer of a transformers DynamicCache."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


class BatchKV:
    """Left-padded KV of the requests decoding together."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []
        self.mask: torch.Tensor | None = None  # [B, width] long, 1 = real token

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache is not None
        return cache_layers(self.cache)

    def row(self, index: int) -> LayerKV:
        """Row `index`'s KV without padding, per layer [H, n, D] (views into the batch)."""
        n = self.lengths[index]
        return [
            (k[index, :, k.shape[2] - n :], v[index, :, v.shape[2] - n :]) for k, v in self.layers()
        ]

    def add_rows(self, rows: list[tuple[DynamicCache, int]]) -> None:
        """Append rows, each a batch-1 cache holding exactly its `length` tokens."""
        blocks = ([(self.layers(), self.lengths)] if self.size else []) + [
            (cache_layers(cache), [n]) for cache, n in rows
        ]
        width = max(kv[0][0].shape[2] for kv, _ in blocks)
        merged = []
        for layer in range(len(blocks[0][0])):
            keys, values = [], []
            for kv, _ in blocks:
                k, v = kv[layer]
                pad = width - k.shape[2]
                keys.append(F.pad(k, (0, 0, pad, 0)) if pad else k)
                values.append(F.pad(v, (0, 0, pad, 0)) if pad else v)
            merged.append((torch.cat(keys), torch.cat(values)))
        self.lengths = [n for _, lengths in blocks for n in lengths]
        self._reset(merged)

    def keep_rows(self, indices: list[int]) -> None:
        """Keep only the rows at `indices` (in that order); trims columns no row needs."""
        if not indices:
            self.cache, self.lengths, self.mask = None, [], None
            return
        self.lengths = [self.lengths[i] for i in indices]
        width = max(self.lengths)
        index = torch.tensor(indices, device=self.mask.device if self.mask is not None else None)
        kept = [
            (
                k.index_select(0, index)[:, :, k.shape[2] - width :],
                v.index_select(0, index)[:, :, v.shape[2] - width :],
            )
            for k, v in self.layers()
        ]
        self._reset(kept)

    def _reset(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache = growing_cache(layers)
        width = layers[0][0].shape[2]
        device = layers[0][0].device
        columns = torch.arange(width, device=device)[None, :]
        starts = torch.tensor([width - n for n in self.lengths], device=device)[:, None]
        self.mask = (columns >= starts).long()

    def extend_mask(self) -> torch.Tensor:
        """The attention mask for one more decoded token per row (also kept for the next step)."""
        assert self.mask is not None
        self.mask = F.pad(self.mask, (0, 1), value=1)
        self.lengths = [n + 1 for n in self.lengths]
        return self.mask
