"""The running batch a scheduler decodes: the interface and its two implementations.

`SlotBatch` (slot_batch.py) keeps a preallocated KV slot per request and runs the engine's own
forward (CUDA graphs on GPU); `PaddedBatch` here runs the transformers model over one
left-padded cache (batch_kv.py), which serves any causal LM. `make_running_batch` picks the
one the model runner chose (`engine.decode_backend`).

A request joins in two steps: `prefill` computes its prompt's KV into a pending row (the
scheduler inserts it into the prefix cache and samples its first token), then `add_rows`
makes pending rows part of the batch, or `discard` drops one that already finished.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.engine.batch_kv import BatchKV, cache_layers
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.radix_cache import KV

PrefillJob = tuple[list[int], KV | None, bool]  # tokens, cached prefix, all logits?


class RunningBatch(Protocol):
    """Rows decoding together; `lengths[i]` tokens of row i have their KV stored."""

    lengths: list[int]

    @property
    def size(self) -> int: ...

    def prefill(self, jobs: list[PrefillJob]) -> list[tuple[torch.Tensor, Any]]:
        """Per job (tokens, cached prefix KV or None, all logits?): (logits [n or 1, V] of the
        tokens after the prefix, a pending row)."""

    def pending_row(self, pending: Any) -> KV:
        """A pending row's KV, in the form the backend's prefix cache holds (radix_cache.KV)."""

    def discard(self, pending: Any) -> None: ...

    def add_rows(self, pending: list[Any]) -> None: ...

    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        """Forward each row's newest token; returns logits [B, V] (lengths grow by one)."""

    def row(self, index: int) -> KV: ...

    def keep_rows(self, indices: list[int]) -> None:
        """Keep only the rows at `indices`, in that order."""


class PaddedBatch(BatchKV):
    """The transformers forward over a left-padded DynamicCache (any causal LM)."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.runner = runner

    def prefill(self, jobs: list[PrefillJob]) -> list[tuple[torch.Tensor, Any]]:
        out = []
        for tokens, prefix, all_logits in jobs:
            assert not isinstance(prefix, torch.Tensor), "this backend's cache holds layers"
            logits, cache = self.runner.prefill(tokens, prefix, all_logits=all_logits)
            out.append((logits, (cache, len(tokens))))
        return out

    def pending_row(self, pending: Any) -> KV:
        return [(k[0], v[0]) for k, v in cache_layers(pending[0])]

    def discard(self, pending: Any) -> None:
        pass

    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        return self.runner.decode(last_tokens, self)


def make_running_batch(runner: ModelRunner, config: EngineConfig) -> RunningBatch:
    if runner.decode_backend == "slots":
        from services.engine.slot_batch import SlotBatch

        return SlotBatch(runner, config.max_running_requests, runner.slot_len, config.cuda_graph)
    return PaddedBatch(runner)
