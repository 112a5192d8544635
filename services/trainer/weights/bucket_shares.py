"""What the trainer's colocated sync shares per bucket, so that every sync after the first few
names the same IPC handles in the same payload, which the engines keep mapped
(engine/shared_tensors.py) and load with one grouped copy.

Per bucket layout (its names and shapes, on one device), `BucketShares` picks one of three:

- fresh: the first time, CUDA tensors of the engine dtype (or CPU tensors already in shared
  memory) go as they are, pickled anew (what any sender does); their storages are remembered
  by weak reference.
- direct: the next time, if every one of those tensors is the same live storage as before (a
  trainer handing out its own parameters, or views of them), the bucket keeps going as it is:
  pickled once, no copy at all. A live storage cannot move, so its handle stays valid.
- staged: otherwise (new tensors every sync, another dtype, not contiguous, on CPU), the
  bucket is copied into a staging buffer of the engine dtype with one grouped copy, and the
  payload of that layout is pickled once. The tensors lie in the buffer as common/
  tensor_layout.py lays them out, as an engine lays out its parameters: a bucket in the
  engine's order then loads there as one copy. One buffer per device serves every staged bucket of
  every sync (the engines load a bucket before the next is copied in); it grows to the
  largest staged bucket, and its memory is held for as long as the sharer lives.

A direct bucket whose storages change becomes staged. On CPU the staging buffer is a
shared-memory file (torch's file_system strategy). Used by
weight_ipc.py's sender and by the rollout-service sync (weight_sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing.reductions import StorageWeakRef

from services.common.tensor_layout import aligned
from services.common.tensor_payload import encode

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class _Layout:
    mode: str  # fresh, direct or staged
    payload: str = ""
    views: Bucket = field(default_factory=list)  # staged: the buffer's views
    ptrs: list[int] = field(default_factory=list)
    refs: list[StorageWeakRef] = field(default_factory=list)

    def same_storages(self, ptrs: list[int]) -> bool:
        return ptrs == self.ptrs and not any(ref.expired() for ref in self.refs)


class BucketShares:
    """Shares buckets of the engine dtype `dtype` (see the module docstring); `direct` False
    stages every bucket."""

    def __init__(self, dtype: torch.dtype, direct: bool = True) -> None:
        self.dtype = dtype
        self.direct = direct
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[tuple[Any, ...], _Layout] = {}

    def share(self, bucket: Bucket) -> tuple[str, Bucket]:
        """The bucket's payload and the tensors it names (staged: views of the buffer, valid
        until the next `share`). Returns once they hold the bucket's values."""
        device = bucket[0][1].device
        layout = (device, tuple((name, tuple(t.shape)) for name, t in bucket))
        known = self._layouts.get(layout)
        ptrs = [t.data_ptr() for _, t in bucket]
        if known is None or known.mode != "staged" and not (
                known.mode == "direct" and known.same_storages(ptrs)):
            known = self._decide(layout, bucket, ptrs, known)
        if known.mode == "staged":  # one grouped copy (casting, gathering strided sources)
            torch._foreach_copy_([v for _, v in known.views], [t for _, t in bucket])
        if device.type == "cuda":
            # The engines read without waiting on an event of ours for a payload they keep.
            torch.cuda.current_stream(device).synchronize()
        if known.mode == "fresh":
            return encode(bucket), bucket
        return known.payload, known.views or bucket

    def modes(self) -> dict[str, int]:
        """How many bucket layouts go fresh, direct and staged."""
        counts = {"fresh": 0, "direct": 0, "staged": 0}
        for known in self._layouts.values():
            counts[known.mode] += 1
        return counts

    @property
    def num_bytes(self) -> int:
        """The memory the staging buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _decide(self, layout: tuple[Any, ...], bucket: Bucket, ptrs: list[int],
                known: _Layout | None) -> _Layout:
        as_is = self.direct and all(
            (t.device.type == "cuda" or t.is_shared()) and t.dtype == self.dtype
            and t.is_contiguous() for _, t in bucket)
        if as_is and known is None:
            decided = _Layout("fresh", ptrs=ptrs,
                              refs=[StorageWeakRef(t.untyped_storage()) for _, t in bucket])
        elif as_is and known is not None and known.same_storages(ptrs):
            decided = _Layout("direct", encode(bucket), [], ptrs, known.refs)
        else:
            views = self._stage(layout[0], bucket)
            decided = _Layout("staged", encode(views), views)
        self._layouts[layout] = decided
        return decided

    def _stage(self, device: torch.device, bucket: Bucket) -> Bucket:
        starts, numel = [], 0
        for _, tensor in bucket:  # as an engine lays out its parameters (tensor_layout.py)
            starts.append(aligned(numel, self.dtype.itemsize))
            numel = starts[-1] + tensor.numel()
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < numel:
            # A new handle: the layouts staged in the old buffer are pickled again.
            self._layouts = {k: v for k, v in self._layouts.items()
                             if k[0] != device or v.mode != "staged"}
            buffer = torch.empty(numel, dtype=self.dtype, device=device)
            if device.type == "cpu":
                torch_mp.set_sharing_strategy("file_system")
                buffer.share_memory_()
            self._buffers[device] = buffer
        return [(name, buffer[start:start + tensor.numel()].view(tensor.shape))
                for (name, tensor), start in zip(bucket, starts, strict=True)]
