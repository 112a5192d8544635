"""consistent_hash: a hash ring with virtual nodes over the session key.

The ring holds every registered target (`num_virtual_nodes` points each), so a target that is
briefly unroutable moves only its own sessions: a lookup walks clockwise past targets that are
not routable now or are draining. Calls without a session key go to the least-loaded target
(hashing them alike would pile them onto one engine).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

from services.router.policies.base import Choice, Policy, accepting_new, least_loaded
from services.router.targets import Target


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    """Session key -> first usable target clockwise on the ring."""

    name = "consistent_hash"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._points: list[int] = []
        self._owners: list[Target] = []
        self._ring_ids: tuple[str, ...] = ()
        self._on_ring: set[int] = set()
        self._vnodes = 0

    def on_targets_changed(self, targets: Sequence[Target]) -> None:
        ids = tuple(t.id for t in targets)
        if ids == self._ring_ids and self._vnodes == self.config.num_virtual_nodes:
            return
        ring = sorted((_hash(f"{t.id}#{v}"), t.id, t) for t in targets
                      for v in range(self.config.num_virtual_nodes))
        self._points = [point for point, _, _ in ring]
        self._owners = [target for _, _, target in ring]
        self._ring_ids, self._vnodes = ids, self.config.num_virtual_nodes
        self._on_ring = {id(t) for t in targets}

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        usable = accepting_new(candidates)
        if not session_key or not usable:
            target = least_loaded(usable)
            return Choice(target) if target is not None else None
        if any(id(t) not in self._on_ring for t in usable):
            self.on_targets_changed(list(dict.fromkeys([*self._owners, *usable])))
        usable_ids = {id(t) for t in usable}
        start = bisect.bisect(self._points, _hash(session_key))
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if id(owner) in usable_ids:
                return Choice(owner)
        return None

    def state(self) -> dict[str, Any]:
        return {"ring_points": len(self._points)}
