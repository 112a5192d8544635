"""sticky_min_load (default): a session's first call goes to the least-loaded target and its
later calls stick there, so each turn finds the previous turns' prefix in that target's cache.

- The session -> target map is explicit, so adding engines moves no session.
- New sessions go where the fewest *active* sessions live (a call within `session_idle_s`),
  then the fewest calls in flight: a session between turns will be back, so counting only
  in-flight calls would pile new sessions onto targets whose sessions are busy with tools.
- When the sticky target is not routable (ejected, stale weights, circuit open, deregistered)
  the session moves once, to the least-loaded target, and sticks to its new home.
- Bounded load: when the sticky target would carry more than `max_load_skew` x the mean
  in-flight load (and at least `spill_min_in_flight` calls), this one call spills to the
  least-loaded target; the session keeps its home.
- A draining target keeps serving the sessions it already has and takes no new ones.
- Calls without a session key are routed by least load and remembered nowhere.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from services.router.policies.base import Choice, Policy, accepting_new, least_loaded
from services.router.targets import Target


class StickyMinLoad(Policy):
    """Sticky per session, least-loaded for new sessions, bounded-load spill."""

    name = "sticky_min_load"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # Both ordered oldest first; a session idle for session_idle_s moves to `idle`.
        self.active: OrderedDict[str, tuple[Target, float]] = OrderedDict()
        self.idle: OrderedDict[str, Target] = OrderedDict()
        self.num_active: dict[int, int] = {}
        self.num_moves = 0

    def home_of(self, session_key: str) -> Target | None:
        entry = self.active.get(session_key)
        return entry[0] if entry is not None else self.idle.get(session_key)

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        now = time.monotonic()
        self._expire(now)
        if not session_key:
            target = self._least_loaded(accepting_new(candidates))
            return Choice(target) if target is not None else None
        home = self.home_of(session_key)
        if home is not None and any(t is home for t in candidates):
            self._touch(session_key, home, now)
            return self._maybe_spill(home, candidates)
        target = self._least_loaded(accepting_new(candidates))
        if target is None:
            return None
        self.num_moves += home is not None
        self._touch(session_key, target, now)
        return Choice(target)

    def _least_loaded(self, targets: Sequence[Target]) -> Target | None:
        if not targets:
            return None
        fewest = min(self.num_active.get(id(t), 0) for t in targets)
        return least_loaded([t for t in targets if self.num_active.get(id(t), 0) == fewest])

    def _touch(self, key: str, target: Target, now: float) -> None:
        previous = self.active.pop(key, None)
        if previous is not None:
            self.num_active[id(previous[0])] -= 1
        self.idle.pop(key, None)
        self.active[key] = (target, now)
        self.num_active[id(target)] = self.num_active.get(id(target), 0) + 1
        while len(self.active) + len(self.idle) > self.config.max_sticky_sessions:
            if self.idle:
                self.idle.popitem(last=False)
            else:
                self._retire(*self.active.popitem(last=False))

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.session_idle_s
        while self.active:
            key, (target, seen) = next(iter(self.active.items()))
            if seen >= cutoff:
                break
            del self.active[key]
            self._retire(key, (target, seen))
            self.idle[key] = target

    def _retire(self, key: str, entry: tuple[Target, float]) -> None:
        self.num_active[id(entry[0])] -= 1

    def _maybe_spill(self, home: Target, candidates: Sequence[Target]) -> Choice:
        load = home.in_flight + 1
        mean = (sum(t.in_flight for t in candidates) + 1) / len(candidates)
        if load < self.config.spill_min_in_flight or load <= self.config.max_load_skew * mean:
            return Choice(home)
        others = [t for t in accepting_new(candidates) if t is not home]
        best = min(others, key=lambda t: (t.in_flight, t.reported_tokens), default=None)
        if best is None or best.in_flight + 1 >= load:
            return Choice(home)
        return Choice(best, spilled=True)

    def on_targets_changed(self, targets: Sequence[Target]) -> None:
        alive = {id(t) for t in targets}
        for key in [k for k, (t, _) in self.active.items() if id(t) not in alive]:
            self._retire(key, self.active.pop(key))
        for key in [k for k, t in self.idle.items() if id(t) not in alive]:
            del self.idle[key]

    def state(self) -> dict[str, Any]:
        return {"sticky_sessions": len(self.active) + len(self.idle),
                "active_sessions": len(self.active), "session_moves": self.num_moves}
