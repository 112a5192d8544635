"""Memory tags as SGLang names them, and KV slots whose storage is freed and allocated again."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequest
from services.engine.memory_occupation import TAGS, parse_tags
from services.engine.slot_kv import SlotKV


def test_tags() -> None:
    assert parse_tags(None) == parse_tags([]) == list(TAGS)
    assert parse_tags(["weights", "weights"]) == ["weights"]
    with pytest.raises(InvalidRequest, match=r"unknown memory tag\(s\) \['gpu'\]"):
        parse_tags(["gpu"])
    with pytest.raises(InvalidRequest, match="list of strings"):
        parse_tags("weights")


def test_slot_storage_is_freed_only_when_no_slot_is_in_use_and_comes_back_zeroed() -> None:
    kv = SlotKV(num_layers=2, num_slots=3, slot_len=8, kv_heads=1, head_dim=4,
                dtype=torch.float32, device=torch.device("cpu"))
    full = kv.num_bytes
    slot = kv.allocate()
    kv.keys[0][slot].fill_(5)
    with pytest.raises(ValueError, match="in use"):
        kv.free_storage()
    kv.release(slot)
    kv.free_storage()
    assert kv.num_bytes == 0 and kv.keys == []
    kv.allocate_storage()
    assert kv.num_bytes == full and all(float(k.abs().sum()) == 0 for k in kv.keys)
