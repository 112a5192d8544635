"""round_robin: calls take turns over the targets (a baseline with no stickiness)."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import Choice, Policy, accepting_new
from services.router.targets import Target


class RoundRobin(Policy):
    """The next target in turn, skipping draining ones."""

    name = "round_robin"
    _counter = 0

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        open_targets = accepting_new(candidates)
        if not open_targets:
            return None
        self._counter += 1
        return Choice(open_targets[self._counter % len(open_targets)])
