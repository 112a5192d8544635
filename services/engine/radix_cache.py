"""A radix tree of token sequences holding their KV, with a token budget and LRU eviction.

Each node owns the KV of its edge's tokens as per-layer (key, value) tensors shaped
[kv_heads, tokens, head_dim], so a matched prefix is a concatenation of slices. Requests copy
what they match, so a node can be evicted at any time without touching running requests.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Node:
    key: list[int]
    kv: LayerKV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


def _slice(kv: LayerKV, start: int, end: int | None = None) -> LayerKV:
    return [(k[:, start:end], v[:, start:end]) for k, v in kv]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    """Prefix cache of one dp rank; `max_num_tokens` = 0 disables it."""

    def __init__(self, max_num_tokens: int) -> None:
        self.max_num_tokens = max_num_tokens
        self._clock = itertools.count(1)
        self.flush()

    def flush(self) -> None:
        self.root = _Node(key=[], kv=[], parent=None)
        self.num_tokens = 0

    def match_len(self, tokens: list[int]) -> int:
        """Length of the longest cached prefix of `tokens` (no KV gathered, no LRU touch)."""
        node, pos = self.root, 0
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            common = common_prefix_len(child.key, tokens[pos:])
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def match_prefix(self, tokens: list[int]) -> tuple[int, LayerKV | None]:
        """Longest cached prefix of `tokens`: (its length, per-layer KV [H, n, D] or None)."""
        node, pos, pieces = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            common = common_prefix_len(child.key, tokens[pos:])
            child.last_access = now
            pieces.append(child.kv if common == len(child.key) else _slice(child.kv, 0, common))
            pos += common
            if common < len(child.key):
                break
            node = child
        if pos == 0:
            return 0, None
        merged = [
            (
                torch.cat([p[layer][0] for p in pieces], dim=1),
                torch.cat([p[layer][1] for p in pieces], dim=1),
            )
            for layer in range(len(pieces[0]))
        ]
        return pos, merged

    def insert(self, tokens: list[int], kv: LayerKV) -> None:
        """Cache `tokens` with their KV (per layer [H, len(tokens), D]); then evict to budget."""
        if self.max_num_tokens == 0 or not tokens:
            return
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(
                    key=list(tokens[pos:]),
                    kv=[(k.clone(), v.clone()) for k, v in _slice(kv, pos)],
                    parent=node,
                    last_access=now,
                )
                node.children[tokens[pos]] = leaf
                self.num_tokens += len(leaf.key)
                break
            common = common_prefix_len(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        self.evict(self.num_tokens - self.max_num_tokens)

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(key=child.key[:at], kv=_slice(child.kv, 0, at), parent=parent)
        head.last_access = child.last_access
        parent.children[head.key[0]] = head
        child.key, child.kv, child.parent = child.key[at:], _slice(child.kv, at), head
        head.children[child.key[0]] = child
        return head

    def evict(self, num_tokens: int) -> int:
        """Drop least-recently-used leaves until `num_tokens` are freed; returns tokens freed."""
        if num_tokens <= 0:
            return 0
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self.num_tokens -= freed
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
