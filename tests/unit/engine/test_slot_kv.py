"""The KV slots' one stacked storage: every layer's keys and values are views of it, a row is
one view of every layer, and a cached prefix goes into a slot in one copy."""

from __future__ import annotations

import torch

from services.engine.slot_kv import SlotKV


def slots() -> SlotKV:
    return SlotKV(num_layers=3, num_slots=4, slot_len=16, kv_heads=2, head_dim=5,
                  dtype=torch.float32, device=torch.device("cpu"))


def test_layers_rows_and_writes_share_one_storage() -> None:
    kv = slots()
    assert not kv.stacked_rows  # the CPU's rows are per layer; a GPU's stacked
    assert kv.row(2, 4)[1][0].shape == (2, 4, 5)
    kv.stacked_rows = True
    assert kv.storage is not None and kv.storage.shape == (3, 2, 5, 2, 16, 5)
    kv.keys[1][2, :, 3] = 4.0  # a layer's view, as the forward writes it
    kv.values[2][2, :, 0] = -1.0
    row = kv.row(2, 4)
    assert row.shape == (3, 2, 2, 4, 5)
    assert torch.equal(row[1, 0, :, 3], torch.full((2, 5), 4.0))
    assert torch.equal(row[2, 1, :, 0], torch.full((2, 5), -1.0))
    assert kv.num_bytes == kv.storage.numel() * 4
    prefix = torch.randn(3, 2, 2, 6, 5)
    kv.write(0, prefix)  # stacked: one copy into the first 6 columns
    assert torch.equal(kv.row(0, 6), prefix)
    assert torch.equal(kv.keys[2][0, :, :6], prefix[2, 0])
    per_layer = [(prefix[layer, 0, :, :3], prefix[layer, 1, :, :3]) for layer in range(3)]
    kv.write(3, per_layer)  # the per-layer form is still taken
    assert torch.equal(kv.row(3, 3), prefix[:, :, :, :3])
    assert torch.count_nonzero(kv.row(1, 16)) == 0  # other slots untouched


def test_storage_is_released_and_allocated_again_zeroed() -> None:
    kv = slots()
    kv.keys[0].fill_(1.0)
    kv.free_storage()
    assert kv.storage is None and kv.keys == [] and kv.num_bytes == 0
    kv.allocate_storage()
    assert kv.storage is not None and torch.count_nonzero(kv.storage) == 0
    assert kv.keys[0].data_ptr() == kv.storage.data_ptr()
