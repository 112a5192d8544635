"""The engine's cache of shared-tensor payloads: kept from their second arrival, replaced per
bucket slot, bounded, cleared on release without forgetting what came before."""

from __future__ import annotations

import torch

from services.engine.shared_tensors import SharedTensorCache, WeightCopy


def copy_of(n: int = 1) -> WeightCopy:
    return WeightCopy([torch.zeros(2) for _ in range(n)], [torch.ones(2) for _ in range(n)])


def test_a_payload_is_kept_from_its_second_arrival() -> None:
    cache = SharedTensorCache()
    assert cache.get(None, "p1") is None
    cache.loaded(None, "p1", ("a",), copy_of())
    assert cache.get(None, "p1") is None  # once: perhaps a buffer the sender frees next
    kept = copy_of()
    cache.loaded(None, "p1", ("a",), kept)
    assert cache.get(None, "p1") is kept
    assert cache.get("flattened_bucket", "p1") is None  # the format is part of the key
    assert cache.stats() == {"num_entries": 1, "num_opened": 2, "num_reused": 1}


def test_a_new_payload_for_the_same_names_replaces_the_old_one() -> None:
    cache = SharedTensorCache()
    for _ in range(2):
        cache.loaded(None, "old", ("a", "b"), copy_of())
        cache.loaded(None, "other", ("c",), copy_of())
    cache.loaded(None, "new", ("a", "b"), copy_of())  # the sender's buffer changed
    assert cache.get(None, "old") is None
    assert cache.get(None, "other") is not None
    cache.loaded(None, "new", ("a", "b"), copy_of())
    assert cache.get(None, "new") is not None


def test_release_clears_the_entries_but_remembers_the_payloads() -> None:
    cache = SharedTensorCache()
    cache.loaded(None, "p", ("a",), copy_of())
    cache.loaded(None, "p", ("a",), copy_of())
    source = cache.get(None, "p")
    assert source is not None
    cache.clear()
    assert cache.get(None, "p") is None and cache.stats()["num_entries"] == 0
    cache.loaded(None, "p", ("a",), copy_of())  # after a release: kept at once again
    assert cache.get(None, "p") is not None


def test_entries_are_bounded() -> None:
    cache = SharedTensorCache(max_entries=2)
    for _ in range(2):
        for slot in ("a", "b", "c"):
            cache.loaded(None, slot, (slot,), copy_of())
    assert cache.stats()["num_entries"] == 2
    assert cache.get(None, "a") is None and cache.get(None, "c") is not None
