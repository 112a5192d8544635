"""sticky_min_load (default): a session's first call goes to the target with the fewest live
sessions (ties: the least live load) and its later calls stick there, so each turn finds the
previous turns' prefix in that target's cache. It trades cache for balance only where that
pays.

- Live load = the calls a target can expect in flight: the sum, over the sessions live on
  it, of each session's share of time spent in a call (measured from its own calls: an
  agent in long tool calls weighs less than one generating long outputs, and sessions on a
  slower or queueing engine weigh more). It breaks ties between targets with as many live
  sessions: placed by it first, new sessions balanced worse than by the count, which is
  exact where the load is an estimate (bench/router.py --repeats 4, base trace: steady
  imbalance 0.015 above perfect stickiness's, 95% interval 0.006-0.023; by count first
  0.009 below it, interval -0.037 to 0.019). A session is live from its first call until
  `EndSession` (the sandbox sends it when an episode ends) or, as a safety net, until it
  made no call for `session_idle_s`.
- Move for load only at a gain: the session moves to the least-delayed target when the
  expected queueing delay at home exceeds the delay there plus the cost of prefilling the
  session's cached context again (`reprefill_s_per_1k_tokens`). Queueing delay comes from
  the engine's `max_running_requests` and the router's in-flight count (or the engine's
  reported waiting requests) and its measured latency per call: below the running cap a
  continuous-batching engine queues nothing, so nothing moves. A session moves at most once
  per `min_calls_between_moves` of its calls. The moved session makes its new target home,
  so its next turn hits there rather than missing at both.
- When the home target is not routable (ejected, stale weights, circuit open, deregistered)
  the session moves to the least-loaded target and sticks to its new home.
- A draining target keeps serving the sessions it already has and takes no new ones.
- Calls without a session key are routed by least load and remembered nowhere.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from services.router.policies.base import Choice, Policy, accepting_new
from services.router.targets import Target


class _Session:
    __slots__ = ("target", "seen", "ended", "duty", "live", "context_tokens",
                 "calls_since_move")

    def __init__(self, target: Target, now: float, duty: float) -> None:
        self.target = target
        self.seen = now      # its last call started
        self.ended = 0.0     # its last call ended (0: not yet)
        self.duty = duty     # share of its time in a call
        self.live = False
        self.context_tokens = 0
        self.calls_since_move = 0


class StickyMinLoad(Policy):
    """Sticky per session; new sessions by live load; moves only when queueing costs more."""

    name = "sticky_min_load"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # Both oldest call first; a live session idle for session_idle_s leaves `live`.
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.live: OrderedDict[str, _Session] = OrderedDict()
        self.expected: dict[int, float] = {}  # target -> expected calls in flight
        self.live_count: dict[int, int] = {}  # target -> live sessions
        self.mean_duty = 0.5
        self.num_moves = 0
        self.num_load_moves = 0

    def home_of(self, session_key: str) -> Target | None:
        session = self.sessions.get(session_key)
        return session.target if session is not None else None

    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        now = time.monotonic()
        self._expire(now)
        if not session_key:
            target = self._least_loaded(accepting_new(candidates))
            return Choice(target) if target is not None else None
        session = self.sessions.get(session_key)
        if session is not None and any(t is session.target for t in candidates):
            better = self._worth_moving(session, candidates)
            if better is None:
                self._touch(session_key, session, session.target, now)
                return Choice(session.target)
            self.num_load_moves += 1
            self._touch(session_key, session, better, now)
            return Choice(better, spilled=True)
        target = self._least_loaded(accepting_new(candidates))
        if target is None:
            return None
        if session is not None:
            self.num_moves += 1
        self._touch(session_key, session, target, now)
        return Choice(target)

    def _load(self, target: Target) -> tuple[int, float, int, int, int]:
        return (self.live_count.get(id(target), 0), round(self.expected.get(id(target), 0.0), 6),
                target.in_flight, target.reported_tokens, target.num_assigned)

    def _least_loaded(self, targets: Sequence[Target]) -> Target | None:
        best = min(targets, key=self._load, default=None)
        if best is not None:
            best.num_assigned += 1
        return best

    def _worth_moving(self, session: _Session, candidates: Sequence[Target]) -> Target | None:
        home = session.target
        if session.calls_since_move < self.config.min_calls_between_moves:
            return None
        delay_home = home.queue_delay_s()
        if delay_home <= 0:
            return None
        others = [t for t in accepting_new(candidates) if t is not home]
        best = min(others, key=lambda t: (t.queue_delay_s(), self._load(t)), default=None)
        if best is None:
            return None
        reprefill_s = session.context_tokens / 1000 * self.config.reprefill_s_per_1k_tokens
        return best if delay_home > best.queue_delay_s() + reprefill_s else None

    def _touch(self, key: str, session: _Session | None, target: Target, now: float) -> None:
        if session is None:
            session = _Session(target, now, self.mean_duty)
        else:
            self.sessions.move_to_end(key)
            if session.live:
                self._weigh(session, -1)
            if session.ended > session.seen:  # its previous call is over: how busy was it?
                busy = session.ended - session.seen
                sample = busy / max(busy + now - session.ended, 1e-9)
                session.duty = 0.5 * session.duty + 0.5 * sample
                self.mean_duty = 0.95 * self.mean_duty + 0.05 * sample
            if session.target is not target:
                session.target, session.calls_since_move = target, 0
            session.seen = now
        session.live = True
        self._weigh(session, 1)
        session.calls_since_move += 1
        self.sessions[key] = session
        self.live.pop(key, None)
        self.live[key] = session
        while len(self.sessions) > self.config.max_sticky_sessions:
            self._forget(next(iter(self.sessions)))

    def _weigh(self, session: _Session, sign: int) -> None:
        key = id(session.target)
        self.expected[key] = self.expected.get(key, 0.0) + sign * session.duty
        self.live_count[key] = self.live_count.get(key, 0) + sign

    def _forget(self, key: str) -> bool:
        session = self.sessions.pop(key, None)
        if session is None:
            return False
        self.live.pop(key, None)
        if session.live:
            self._weigh(session, -1)
        return True

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.session_idle_s
        while self.live:
            session = next(iter(self.live.values()))
            if session.seen >= cutoff:
                break
            self.live.popitem(last=False)
            session.live = False
            self._weigh(session, -1)

    def on_served(self, session_key: str, target: Target, context_tokens: int) -> None:
        session = self.sessions.get(session_key)
        if session is not None and session.target is target:
            session.context_tokens = context_tokens
            session.ended = time.monotonic()

    def end_session(self, session_key: str) -> bool:
        return self._forget(session_key)

    def on_targets_changed(self, targets: Sequence[Target]) -> None:
        alive = {id(t) for t in targets}
        for key in [k for k, s in self.sessions.items() if id(s.target) not in alive]:
            self._forget(key)

    def state(self) -> dict[str, Any]:
        return {"sticky_sessions": len(self.sessions),
                "active_sessions": len(self.live),
                "session_moves": self.num_moves, "load_moves": self.num_load_moves}
