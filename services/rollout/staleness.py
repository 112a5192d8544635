"""Staleness control: how far generation may run ahead of the trainer.

The rule (AReaL's, in samples): the trainer consumes `batch_samples` samples per weight
version, in the order groups reach the buffer. Counting every sample admitted since the
scheduler started at version `base` (minus those of dropped groups), a new sample may start at
version `v` only if

    admitted + 1 <= (v - base + max_staleness + 1) * batch_samples

so a sample started at version `v` falls in a batch the trainer consumes at version
`v + max_staleness` or earlier. Episodes finish out of order, so a long-tailed one can still
land in a later batch; therefore each complete group is also checked when it is accepted: its
consumption version is predicted from its place in the buffer order, and a group that would be
consumed more than `max_staleness` versions after its oldest token is dropped as stale (and a
group is cut short, its running episodes cancelled, as soon as one finished sample proves it
would be). The admission rule keeps those drops rare (bench/overlap.py reports them).

Groups already in the stream when the scheduler starts (a restarted rollout service, a
backlog behind a slow trainer) are consumed first: they count as admitted and accepted from
the start, so new samples are admitted and judged as landing behind them.

Assumes one weight-version bump per batch, as the trainer does when it syncs every step.
"""

from __future__ import annotations

from services.rollout.config import SchedulerConfig


class StalenessGate:
    """Admission and acceptance checks against `max_staleness` (None: no limit)."""

    def __init__(self, config: SchedulerConfig, weight_version: int,
                 backlog_samples: int = 0) -> None:
        self._config = config
        self.base_version = weight_version
        self.version = weight_version
        self.admitted = backlog_samples   # samples started and not dropped
        self.accepted = backlog_samples   # samples of groups accepted, in buffer order

    def budget(self) -> int | None:
        """How many more samples may start now (None: unlimited)."""
        staleness = self._config.max_staleness
        if staleness is None:
            return None
        allowed = (self.version - self.base_version + staleness + 1) * self._config.batch_samples
        return max(0, allowed - self.admitted)

    def can_admit(self, num_samples: int) -> bool:
        budget = self.budget()
        return budget is None or num_samples <= budget

    def on_admit(self, num_samples: int) -> None:
        self.admitted += num_samples

    def on_drop(self, num_samples: int) -> None:
        """Samples of a dropped group never reach the trainer: give their budget back."""
        self.admitted -= num_samples

    def predicted_consume_version(self) -> int:
        """The weight version the trainer will hold when it reads the next accepted group."""
        batch_index = self.accepted // self._config.batch_samples
        return max(self.version, self.base_version + batch_index)

    def is_stale(self, min_weight_version: int) -> bool:
        """Whether the next accepted group would be consumed too long after its oldest token."""
        staleness = self._config.max_staleness
        if staleness is None:
            return False
        return self.predicted_consume_version() - min_weight_version > staleness

    def on_accept(self, num_samples: int) -> None:
        self.accepted += num_samples
