"""manual: sglang-router's manual policy with min_load assignment, as a reference.

A session's first call goes to the target with the fewest calls in flight; every later call
sticks there until the target stops being routable, then the session is assigned afresh. No
session lifecycle and no load bound: what a client of sglang-router gets with
`X-SMG-Routing-Key`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.config import RouterConfig
from services.router.policies.base import Choice, Policy, accepting_new, least_loaded
from services.router.targets import Target


class Manual(Policy):
    """Sticky by routing key, least in-flight calls for a new key."""

    name = "manual"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.homes: OrderedDict[str, Target] = OrderedDict()

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        home = self.homes.get(session_key) if session_key else None
        if home is not None and any(t is home for t in candidates):
            self.homes.move_to_end(session_key)
            return Choice(home)
        target = least_loaded(accepting_new(candidates))
        if target is not None and session_key:
            self.homes[session_key] = target
            self.homes.move_to_end(session_key)
            while len(self.homes) > self.config.max_sticky_sessions:
                self.homes.popitem(last=False)
        return Choice(target) if target is not None else None

    def on_targets_changed(self, targets: Sequence[Target]) -> None:
        alive = {id(t) for t in targets}
        for key in [k for k, t in self.homes.items() if id(t) not in alive]:
            del self.homes[key]
