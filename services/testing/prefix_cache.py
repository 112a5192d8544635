"""A radix-tree prefix cache over token ids with a token budget and LRU leaf eviction.

The simulated engine keeps one per dp rank to report `cached_tokens` truthfully: the number of
prompt tokens whose KV a real engine with the same budget would have found in its cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

_clock = itertools.count()


class _Node:
    __slots__ = ("key", "children", "parent", "last_used")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = next(_clock)


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token-id radix tree holding at most `budget_tokens` tokens (least recently used go)."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.root = _Node((), None)
        self.num_tokens = 0

    def match(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `ids`; touches the matched path."""
        node, pos = self.root, 0
        stamp = next(_clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            edge = child.key
            if tuple(ids[pos:pos + len(edge)]) == edge:
                pos += len(edge)
                child.last_used = stamp
                node = child
                continue
            child.last_used = stamp
            pos += _common_len(edge, ids[pos:pos + len(edge)])
            break
        return pos

    def insert(self, ids: Sequence[int]) -> None:
        """Cache `ids` (prompt plus output of a finished request), then evict to the budget."""
        node, pos = self.root, 0
        stamp = next(_clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), node)
                leaf.last_used = stamp
                node.children[ids[pos]] = leaf
                self.num_tokens += len(leaf.key)
                break
            edge = child.key
            common = _common_len(edge, ids[pos:pos + len(edge)])
            if common < len(edge):
                child = self._split(child, common)
            child.last_used = stamp
            node, pos = child, pos + common
        self._evict()

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(child.key[:at], parent)
        head.last_used = child.last_used
        parent.children[head.key[0]] = head
        child.key = child.key[at:]
        child.parent = head
        head.children[child.key[0]] = child
        return head

    def _evict(self) -> None:
        if self.num_tokens <= self.budget_tokens:
            return
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.num_tokens > self.budget_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> None:
        self.root = _Node((), None)
        self.num_tokens = 0
