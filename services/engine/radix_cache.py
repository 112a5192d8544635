"""A radix tree of token sequences holding their KV, with a token budget and LRU eviction.

Each node owns the KV of its edge's tokens, so a matched prefix is a concatenation of slices.
Requests copy what they match, so a node can be evicted at any time without touching running
requests. A cache holds its KV in one of two forms, the form its engine backend hands it:

- `LayerKV`, per-layer (key, value) tensors shaped [kv_heads, tokens, head_dim] (the
  transformers backend's cache rows);
- stacked, one tensor [layers, 2, kv_heads, tokens, head_dim] (the KV slots' rows), where a
  slice, a copy or a concatenation is one operation for every layer at once instead of one
  per layer and per key and value: on a GPU, one kernel launch instead of sixty for a 30-layer
  model, which the engine's loop paid on every insert.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
KV = LayerKV | torch.Tensor  # per layer, or stacked [layers, 2, kv_heads, tokens, head_dim]
TOKEN_DIM = 3  # of the stacked form


@dataclass(eq=False)
class _Node:
    key: list[int]
    kv: KV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


def kv_len(kv: KV) -> int:
    """The number of tokens `kv` holds, in either form."""
    return kv.shape[TOKEN_DIM] if isinstance(kv, torch.Tensor) else kv[0][0].shape[1]


def _slice(kv: KV, start: int, end: int | None = None) -> KV:
    if isinstance(kv, torch.Tensor):
        return kv[:, :, :, start:end]
    return [(k[:, start:end], v[:, start:end]) for k, v in kv]


def _copy(kv: KV) -> KV:
    if isinstance(kv, torch.Tensor):
        return kv.clone(memory_format=torch.contiguous_format)
    return [(k.clone(), v.clone()) for k, v in kv]


def _concat(pieces: list[KV]) -> KV:
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces, dim=TOKEN_DIM)  # type: ignore[arg-type]
    return [(torch.cat([p[layer][0] for p in pieces], dim=1),  # type: ignore[index]
             torch.cat([p[layer][1] for p in pieces], dim=1))  # type: ignore[index]
            for layer in range(len(pieces[0]))]


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

    def match_prefix(self, tokens: list[int]) -> tuple[int, KV | None]:
        """Longest cached prefix of `tokens`: (its length, its KV in the cache's form, or
        None)."""
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
        return pos, _concat(pieces)

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Cache `tokens` with their KV (len(tokens) tokens, either form); then evict to
        budget."""
        if self.max_num_tokens == 0 or not tokens:
            return
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(
                    key=list(tokens[pos:]),
                    kv=_copy(_slice(kv, pos)),
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
