"""The simulated engine's prefix cache: what it reports as cached must be true."""

from __future__ import annotations

from services.testing.prefix_cache import PrefixCache


def test_match_counts_the_longest_cached_prefix() -> None:
    cache = PrefixCache(1000)
    cache.insert([1, 2, 3, 4, 5])
    assert cache.match([1, 2, 3, 4, 5, 6]) == 5
    assert cache.match([1, 2, 9]) == 2
    assert cache.match([7]) == 0
    cache.insert([1, 2, 3, 8])  # splits the edge
    assert cache.match([1, 2, 3, 8, 1]) == 4 and cache.match([1, 2, 3, 4]) == 4
    assert cache.num_tokens == 6


def test_least_recently_used_prefixes_are_evicted_to_the_budget() -> None:
    cache = PrefixCache(10)
    cache.insert([1] * 4)
    cache.insert([2] * 4)
    cache.match([1] * 4)  # touch: [2]*4 is now the least recently used
    cache.insert([3] * 4)
    assert cache.num_tokens <= 10
    assert cache.match([1] * 4) == 4 and cache.match([3] * 4) == 4
    assert cache.match([2] * 4) == 0
