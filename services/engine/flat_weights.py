"""The model's parameters as views of one buffer per dtype and device, in checkpoint order.

A weight update names tensors in a checkpoint's order, and a trainer's sender stages them in
one buffer (trainer/weights/bucket_shares.py), each starting where common/tensor_layout.py
says. With the engine's parameters laid out by the same rule, a run of received tensors in
the engine's order matches its parameters byte for byte, padding included, and weight_copy.py
moves the run as a single device-to-device copy instead of one copy (or one grouped kernel)
per tensor.

The layout follows the model's `state_dict` order (tied parameters once). The buffers are
allocated on the engine's device and filled from wherever the parameters were loaded, so a
model loaded on the CPU never holds two copies of its weights on the GPU. `gaps` maps where a
parameter ends to where the next one starts, wherever padding lies between them: bytes that
no parameter uses, which a copy may overwrite. Releasing the weights (memory_occupation.py)
frees the buffers; resuming allocates them again and points every parameter back at its view,
in the same layout: the contents are lost either way, the next update refills them.

With `flat=False` (the engine's `--no-flat-weights`) every parameter keeps an allocation of
its own, moved to the device as it is, and release and resume free and allocate them one by
one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.tensor_layout import aligned


@dataclass(frozen=True)
class _Slot:
    param: torch.nn.Parameter
    dtype: torch.dtype
    offset: int  # in elements of the buffer
    shape: torch.Size


class FlatWeights:
    """Lays `model`'s parameters out in one buffer per dtype on `device`, and moves them."""

    def __init__(self, model: torch.nn.Module, device: torch.device, flat: bool = True) -> None:
        self.device = device
        self.flat = flat
        seen: set[int] = set()
        params: list[torch.nn.Parameter] = []
        for tensor in model.state_dict(keep_vars=True).values():
            if isinstance(tensor, torch.nn.Parameter) and id(tensor) not in seen:
                seen.add(id(tensor))
                params.append(tensor)
        self.slots: list[_Slot] = []
        self.numel: dict[torch.dtype, int] = {}
        for param in params:
            offset = aligned(self.numel.get(param.dtype, 0), param.element_size())
            self.slots.append(_Slot(param, param.dtype, offset, param.shape))
            self.numel[param.dtype] = offset + param.numel()
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        #: end of a parameter -> start of the next, where padding lies between (addresses)
        self.gaps: dict[int, int] = {}
        self.resident = False
        with torch.no_grad():
            self._allocate(keep_values=True)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def release(self) -> None:
        """Free the weights: every parameter becomes an empty tensor of its dtype."""
        for slot in self.slots:
            slot.param.data = torch.empty(0, dtype=slot.dtype, device=self.device)
        self.buffers.clear()
        self.gaps.clear()
        self.resident = False

    def resume(self) -> None:
        """Allocate the weights again (uninitialised) and point the parameters at them."""
        if not self.resident:
            self._allocate(keep_values=False)

    def _allocate(self, keep_values: bool) -> None:
        self.resident = True
        if not self.flat:
            for slot in self.slots:
                slot.param.data = (slot.param.data.to(self.device) if keep_values else
                                   torch.empty(slot.shape, dtype=slot.dtype, device=self.device))
            return
        self.buffers = {dtype: torch.empty(n, dtype=dtype, device=self.device)
                        for dtype, n in self.numel.items()}
        ends: dict[torch.dtype, int] = {}
        for slot in self.slots:
            buffer = self.buffers[slot.dtype]
            view = buffer[slot.offset:slot.offset + slot.shape.numel()].view(slot.shape)
            if keep_values:
                view.copy_(slot.param.data)
            slot.param.data = view
            end = ends.get(slot.dtype)
            if end is not None and end != slot.offset:
                size = buffer.element_size()
                self.gaps[buffer.data_ptr() + end * size] = buffer.data_ptr() + slot.offset * size
            ends[slot.dtype] = slot.offset + slot.shape.numel()
