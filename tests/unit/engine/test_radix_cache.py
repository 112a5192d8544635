"""The engine's radix prefix cache: matching, splitting, budget and LRU eviction, with its KV
in either form (per layer, as the transformers backend's rows; stacked, as the KV slots')."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.radix_cache import RadixCache, kv_len

LAYERS, HEADS, DIM = 2, 2, 4


@pytest.fixture(params=["layers", "stacked"])
def form(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def kv_for(tokens: list[int], form: str = "layers") -> Any:
    """KV whose every entry encodes its token, so slices can be checked exactly."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(HEADS, -1, DIM)
    layers = [(base + layer, -base - layer) for layer in range(LAYERS)]
    if form == "layers":
        return layers
    return torch.stack([torch.stack(pair) for pair in layers])  # [layers, 2, H, n, D]


def assert_kv_is(kv: Any, tokens: list[int]) -> None:
    assert kv_len(kv) == len(tokens)
    if isinstance(kv, torch.Tensor):  # the stacked form is the per-layer one, stacked
        assert torch.equal(kv, kv_for(tokens, "stacked"))
        return
    for (k, v), (wk, wv) in zip(kv, kv_for(tokens), strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_match_returns_longest_prefix_with_its_kv(form: str) -> None:
    cache = RadixCache(1000)
    assert cache.match_prefix([1, 2, 3]) == (0, None)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5], form))
    n, kv = cache.match_prefix([1, 2, 3, 9])
    assert n == 3
    assert_kv_is(kv, [1, 2, 3])
    n, kv = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert n == 5
    assert_kv_is(kv, [1, 2, 3, 4, 5])
    assert cache.num_tokens == 5


def test_insert_splits_shared_prefixes(form: str) -> None:
    cache = RadixCache(1000)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4], form))
    cache.insert([1, 2, 7, 8, 9], kv_for([1, 2, 7, 8, 9], form))
    assert cache.num_tokens == 4 + 3
    n, kv = cache.match_prefix([1, 2, 7, 8])
    assert n == 4
    assert_kv_is(kv, [1, 2, 7, 8])
    n, kv = cache.match_prefix([1, 2, 3, 4])
    assert n == 4
    assert_kv_is(kv, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4], form))  # already cached: no growth
    assert cache.num_tokens == 7


def test_budget_evicts_least_recently_used_leaves(form: str) -> None:
    cache = RadixCache(10)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4], form))
    cache.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8], form))
    cache.match_prefix([1, 2, 3, 4])  # [5..8] is now the least recently used
    cache.insert([9, 10, 11, 12], kv_for([9, 10, 11, 12], form))
    assert cache.num_tokens <= 10
    assert cache.match_prefix([5, 6, 7, 8])[0] == 0
    assert cache.match_prefix([1, 2, 3, 4])[0] == 4
    assert cache.match_prefix([9, 10, 11, 12])[0] == 4


def test_eviction_climbs_to_parents_and_flush_empties(form: str) -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3], form))
    cache.insert([1, 2, 4], kv_for([1, 2, 4], form))
    assert cache.evict(100) == 4
    assert cache.num_tokens == 0 and cache.match_prefix([1, 2])[0] == 0
    cache.insert([1, 2, 3], kv_for([1, 2, 3], form))
    cache.flush()
    assert cache.num_tokens == 0 and cache.match_prefix([1])[0] == 0


def test_zero_budget_disables_the_cache(form: str) -> None:
    cache = RadixCache(0)
    cache.insert([1, 2, 3], kv_for([1, 2, 3], form))
    assert cache.num_tokens == 0 and cache.match_prefix([1, 2, 3])[0] == 0


def test_the_cache_keeps_a_copy_not_a_view_of_the_row_it_was_given(form: str) -> None:
    cache = RadixCache(1000)
    row = kv_for([1, 2, 3], form)
    row = row.clone() if isinstance(row, torch.Tensor) else [(k.clone(), v.clone())
                                                            for k, v in row]
    cache.insert([1, 2, 3], row)
    if isinstance(row, torch.Tensor):  # the slot's storage is reused by the next request
        row.fill_(-7.0)
    else:
        for k, v in row:
            k.fill_(-7.0)
            v.fill_(-7.0)
    assert_kv_is(cache.match_prefix([1, 2, 3])[1], [1, 2, 3])
