"""min_load: every call goes to the least-loaded target (a baseline with no stickiness)."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import Choice, Policy, accepting_new, least_loaded
from services.router.targets import Target


class MinLoad(Policy):
    """Least in-flight calls wins, whatever the session."""

    name = "min_load"

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        target = least_loaded(accepting_new(candidates))
        return Choice(target) if target is not None else None
