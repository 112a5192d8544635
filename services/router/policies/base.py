"""The routing policy interface, the shared least-loaded rule, and the factory by name.

A policy picks one target for a call from the targets that are routable now (healthy, on the
current weights, circuit closed). It must not send a *new* session to a draining target.
Load is in-flight calls, then engine-reported tokens (`/get_load`), then how often the
target was already picked as a new home, so ties rotate instead of piling onto one target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.router.config import RouterConfig
from services.router.targets import Target


@dataclass
class Choice:
    """Where a call goes; `spilled` when load moved it off its sticky target."""

    target: Target
    spilled: bool = False


def accepting_new(targets: Sequence[Target]) -> list[Target]:
    """Targets that take new sessions (not draining)."""
    return [t for t in targets if not t.draining]


def least_loaded(targets: Sequence[Target]) -> Target | None:
    """The target with the fewest calls in flight (ties: fewer tokens, fewer past picks)."""
    if not targets:
        return None
    best = min(targets, key=lambda t: (t.in_flight, t.reported_tokens, t.num_assigned))
    best.num_assigned += 1
    return best


class Policy(ABC):
    """Chooses a target for each call; `select` is the only required method."""

    name: str = ""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    @abstractmethod
    def select(self, session_key: str, candidates: Sequence[Target]) -> Choice | None:
        """Pick from `candidates` (routable now, never empty); None if none may take it."""

    def on_targets_changed(self, targets: Sequence[Target]) -> None:
        """Called with every registered target (routable or not) when that set changes."""
        return None

    def on_served(self, session_key: str, target: Target, context_tokens: int) -> None:
        """Called after a served call: the session's context (prompt + output) is cached there."""
        return None

    def end_session(self, session_key: str) -> bool:
        """The session is over; True when the policy still held it."""
        return False

    def state(self) -> dict[str, Any]:
        """Policy-specific state for the admin API."""
        return {}


def make_policy(name: str, config: RouterConfig) -> Policy:
    """The policy called `name`, configured from `config`."""
    from services.router.policies.consistent_hash import ConsistentHash
    from services.router.policies.manual import Manual
    from services.router.policies.min_load import MinLoad
    from services.router.policies.round_robin import RoundRobin
    from services.router.policies.sticky_min_load import StickyMinLoad

    policies: dict[str, type[Policy]] = {
        cls.name: cls for cls in (StickyMinLoad, Manual, ConsistentHash, MinLoad, RoundRobin)
    }
    if name not in policies:
        from services.common.errors import ConfigError

        raise ConfigError(f"unknown routing policy {name!r}; choose one of "
                          f"{', '.join(sorted(policies))}")
    return policies[name](config)
