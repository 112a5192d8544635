"""What `/update_weights_from_tensor` keeps between updates, so that a sender re-sending the
same payload (the pickle of its persistent staging buffer) costs one grouped copy: no
unpickling, no opening of CUDA IPC handles or shared-memory files, no name resolution.

An entry is the (parameter views, shared views) a payload resolved to, keyed by the payload
itself. Holding the shared views keeps their mappings open: torch closes a mapping (and its
`rebuild_cuda_tensor` cache forgets the handle) only when the last storage on it goes.

- A payload is kept from its second arrival on: a sender that pickles a new buffer every time
  would otherwise have its freed buckets pinned (CUDA IPC memory stays allocated in the sender
  while a receiver maps it).
- One entry per bucket slot (the payload's names): a new payload for the same names, such as
  a new handle after the sender's buffer grew, replaces the old one and closes its mappings.
- At most `max_entries` entries, the least recently used dropped first.
- Cleared on any memory release: the parameters' storage is freed and moves. Which payloads
  came before is remembered (no memory held), so the next sync after a release keeps its
  payloads again.

Used by weight_routes.py, under its update lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from services.engine.weight_copy import CopyPlan, plan_copy

Key = tuple[str | None, str]  # (load_format, payload)


@dataclass
class WeightCopy:
    """Received tensors and the parameter views they fill, in the same order; the copy's plan
    (weight_copy.py) is made on first use and kept for as long as the entry is (a release,
    which moves the parameters, clears the entries)."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    _plan: CopyPlan | None = field(default=None, repr=False)

    def plan(self, padding: Mapping[int, int] | None = None) -> CopyPlan:
        """The copy's plan; `padding`: the targets' unused gaps (flat_weights.py's `gaps`)."""
        if self._plan is None:
            self._plan = plan_copy(self.targets, self.sources, padding)
        return self._plan


class SharedTensorCache:
    """Resolved payloads whose shared memory stays mapped between updates."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Key, WeightCopy] = OrderedDict()
        self._last: OrderedDict[tuple[str, ...], Key] = OrderedDict()  # slot: its last payload
        #: payloads unpickled (their handles or files opened) and payloads served from here
        self.num_opened = 0
        self.num_reused = 0

    def get(self, load_format: str | None, payload: str) -> WeightCopy | None:
        copy = self._entries.get((load_format, payload))
        if copy is not None:
            self._entries.move_to_end((load_format, payload))
            self.num_reused += 1
        return copy

    def loaded(self, load_format: str | None, payload: str, names: tuple[str, ...],
               copy: WeightCopy) -> None:
        """A newly unpickled payload was loaded: keep it if it came before."""
        key = (load_format, payload)
        self.num_opened += 1
        previous = self._last.pop(names, None)
        self._last[names] = key
        if len(self._last) > 4 * self.max_entries:
            self._last.popitem(last=False)
        if previous is not None and previous != key:
            self._entries.pop(previous, None)
        elif previous == key:
            self._entries[key] = copy
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (closing the mappings nothing else holds)."""
        self._entries.clear()

    def stats(self) -> dict[str, int]:
        return {"num_entries": len(self._entries), "num_opened": self.num_opened,
                "num_reused": self.num_reused}
