"""The engine's radix prefix cache: matching, splitting, budget and LRU eviction."""

from __future__ import annotations

import torch

from services.engine.radix_cache import RadixCache

LAYERS, HEADS, DIM = 2, 2, 4


def kv_for(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose every entry encodes its token, so slices can be checked exactly."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(HEADS, -1, DIM)
    return [(base + layer, -base - layer) for layer in range(LAYERS)]


def assert_kv_is(kv, tokens: list[int]) -> None:
    want = kv_for(tokens)
    for (k, v), (wk, wv) in zip(kv, want, strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_match_returns_longest_prefix_with_its_kv() -> None:
    cache = RadixCache(1000)
    assert cache.match_prefix([1, 2, 3]) == (0, None)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    n, kv = cache.match_prefix([1, 2, 3, 9])
    assert n == 3
    assert_kv_is(kv, [1, 2, 3])
    n, kv = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert n == 5
    assert_kv_is(kv, [1, 2, 3, 4, 5])
    assert cache.num_tokens == 5


def test_insert_splits_shared_prefixes() -> None:
    cache = RadixCache(1000)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([1, 2, 7, 8, 9], kv_for([1, 2, 7, 8, 9]))
    assert cache.num_tokens == 4 + 3
    n, kv = cache.match_prefix([1, 2, 7, 8])
    assert n == 4
    assert_kv_is(kv, [1, 2, 7, 8])
    n, kv = cache.match_prefix([1, 2, 3, 4])
    assert n == 4
    assert_kv_is(kv, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))  # already cached: no growth
    assert cache.num_tokens == 7


def test_budget_evicts_least_recently_used_leaves() -> None:
    cache = RadixCache(10)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8]))
    cache.match_prefix([1, 2, 3, 4])  # [5..8] is now the least recently used
    cache.insert([9, 10, 11, 12], kv_for([9, 10, 11, 12]))
    assert cache.num_tokens <= 10
    assert cache.match_prefix([5, 6, 7, 8])[0] == 0
    assert cache.match_prefix([1, 2, 3, 4])[0] == 4
    assert cache.match_prefix([9, 10, 11, 12])[0] == 4


def test_eviction_climbs_to_parents_and_flush_empties() -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.insert([1, 2, 4], kv_for([1, 2, 4]))
    assert cache.evict(100) == 4
    assert cache.num_tokens == 0 and cache.match_prefix([1, 2])[0] == 0
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.flush()
    assert cache.num_tokens == 0 and cache.match_prefix([1])[0] == 0


def test_zero_budget_disables_the_cache() -> None:
    cache = RadixCache(0)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    assert cache.num_tokens == 0 and cache.match_prefix([1, 2, 3])[0] == 0
