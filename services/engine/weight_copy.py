"""Copying received weights into the parameters they update, at the memory's bandwidth.

`torch._foreach_copy_` groups many copies into few launches, which is what the small tensors
(norms, biases, narrow projections) need, but its chunked kernel moves a large tensor more
slowly than a plain copy, which a contiguous same-dtype pair turns into a device-to-device
memcpy. So the large pairs go one `copy_` each and the rest in one grouped copy.

Before that, pairs that follow each other in the same way on both sides merge into one pair
spanning them: a parameter ends where the next one starts, or only padding of the engine's flat
layout (flat_weights.py's `gaps`) lies between them, and the sources lie the same distance
apart in one storage (a sender's staging buffer laid out by the same rule,
common/tensor_layout.py). A bucket sent in the engine's own order is then a single memcpy; the
padding it also copies is bytes no parameter uses. Working that out costs a few microseconds a
pair, so a `CopyPlan` is made once per received payload and kept with it (shared_tensors.py).
On a CPU all of it is the same loop of copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: pairs of at least this many bytes (target side) are copied one by one
LARGE_BYTES = 1 << 20


def is_large(target: torch.Tensor, source: torch.Tensor) -> bool:
    """A pair a plain copy moves fastest: big, same dtype, both contiguous."""
    return (target.numel() * target.element_size() >= LARGE_BYTES
            and target.dtype == source.dtype
            and target.is_contiguous() and source.is_contiguous())


@dataclass
class CopyPlan:
    """What one load does: `large` pairs one `copy_` each, the `small` ones in one grouped
    copy; `merged` says how many received pairs went into spans of several."""

    large: list[tuple[torch.Tensor, torch.Tensor]]
    small_targets: list[torch.Tensor]
    small_sources: list[torch.Tensor]
    merged: int = 0

    @property
    def num_copies(self) -> int:
        return len(self.large) + (1 if self.small_targets else 0)


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size()


def _gap(prev: torch.Tensor, nxt: torch.Tensor) -> int | None:
    """Bytes from `prev`'s end to `nxt`'s start where `nxt` follows it in the same storage as a
    contiguous tensor of its dtype (None where it does not)."""
    gap = nxt.data_ptr() - _end(prev)
    if (gap < 0 or nxt.dtype != prev.dtype or nxt.device != prev.device
            or not nxt.is_contiguous()
            or nxt.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr()):
        return None
    return gap


def _span(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """A flat tensor over `first`'s storage from where `first` starts to where `last` ends."""
    numel = (_end(last) - first.data_ptr()) // first.element_size()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def _joins(targets: list[torch.Tensor], sources: list[torch.Tensor], j: int,
           padding: Mapping[int, int]) -> bool:
    """Whether pair j continues the run of pair j - 1: the targets back to back or apart by
    padding alone, the sources as far apart as the targets."""
    target_gap = _gap(targets[j - 1], targets[j])
    if target_gap is None or (target_gap and padding.get(_end(targets[j - 1]))
                              != targets[j].data_ptr()):
        return False
    return _gap(sources[j - 1], sources[j]) == target_gap


def merge_runs(targets: list[torch.Tensor], sources: list[torch.Tensor],
               padding: Mapping[int, int] | None = None
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The pairs with every run of pairs that follow each other alike on both sides (same
    dtype on both; `padding`: the target's unused gaps, end -> next start) made one pair of
    flat spans; and how many pairs went into such runs."""
    padding = padding or {}
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    merged = 0
    i = 0
    while i < len(targets):
        j = i + 1
        if (targets[i].is_contiguous() and sources[i].is_contiguous()
                and targets[i].dtype == sources[i].dtype):
            while j < len(targets) and _joins(targets, sources, j, padding):
                j += 1
        if j - i == 1:
            out.append((targets[i], sources[i]))
        else:
            out.append((_span(targets[i], targets[j - 1]), _span(sources[i], sources[j - 1])))
            merged += j - i
        i = j
    return out, merged


def plan_copy(targets: list[torch.Tensor], sources: list[torch.Tensor],
              padding: Mapping[int, int] | None = None) -> CopyPlan:
    if len(targets) != len(sources):
        raise ValueError(f"{len(targets)} targets for {len(sources)} sources")
    pairs, merged = merge_runs(targets, sources, padding)
    plan = CopyPlan([], [], [], merged)
    for target, source in pairs:
        if is_large(target, source):
            plan.large.append((target, source))
        else:
            plan.small_targets.append(target)
            plan.small_sources.append(source)
    return plan


def run_copy(plan: CopyPlan) -> None:
    for target, source in plan.large:
        target.copy_(source)
    if plan.small_targets:
        torch._foreach_copy_(plan.small_targets, plan.small_sources)


def copy_weights(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> int:
    """Copy each source into its target (casting and moving as `copy_` does); returns how many
    copies went one by one (a merged span counts once)."""
    plan = plan_copy(targets, sources)
    run_copy(plan)
    return len(plan.large)
