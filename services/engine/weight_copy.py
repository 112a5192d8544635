"""Copying received weights into the parameters they update, at the memory's bandwidth.

`torch._foreach_copy_` groups many copies into few launches, which is what the small tensors
(norms, biases, narrow projections) need, but its chunked kernel moves a large tensor more
slowly than a plain copy, which a contiguous same-dtype pair turns into a device-to-device
memcpy. So the large pairs go one `copy_` each and the rest in one grouped copy. On a CPU both
are the same loop of copies.
"""

from __future__ import annotations

import torch

#: pairs of at least this many bytes (target side) are copied one by one
LARGE_BYTES = 1 << 20


def is_large(target: torch.Tensor, source: torch.Tensor) -> bool:
    """A pair a plain copy moves fastest: big, same dtype, both contiguous."""
    return (target.numel() * target.element_size() >= LARGE_BYTES
            and target.dtype == source.dtype
            and target.is_contiguous() and source.is_contiguous())


def copy_weights(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> int:
    """Copy each source into its target (casting and moving as `copy_` does); returns how many
    pairs went one by one."""
    if len(targets) != len(sources):
        raise ValueError(f"{len(targets)} targets for {len(sources)} sources")
    small_targets, small_sources, large = [], [], 0
    for target, source in zip(targets, sources, strict=True):
        if is_large(target, source):
            target.copy_(source)
            large += 1
        else:
            small_targets.append(target)
            small_sources.append(source)
    if small_targets:
        torch._foreach_copy_(small_targets, small_sources)
    return large
