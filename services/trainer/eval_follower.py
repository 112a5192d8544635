"""Held-out evaluation results in the trainer's metrics.

The rollout service evaluates the held-out tasks at chosen weight versions while training
goes on and publishes each result as a `rollout.eval` event (services/common/events.py). This
follower reads those events from the run's events stream every few seconds and records them
in the trainer's stats: `/admin/state` shows success by weight version, `/metrics` the latest
result, and the trainer's log a line per result. Events are best effort, so a result the
stream lost is missing here too; samples never depend on it.
"""

from __future__ import annotations

import logging
import threading

import redis

from services.common.config import RedisConfig
from services.common.events import EventTail
from services.trainer.objective.stats import TrainerStats

log = logging.getLogger(__name__)


class EvalFollower:
    """Follows one run's `rollout.eval` events into `stats`."""

    def __init__(self, redis: RedisConfig, run: str, stats: TrainerStats,
                 interval_s: float = 5.0) -> None:
        self._tail = EventTail(redis, run)
        self._stats = stats
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """Read the events since the last poll; returns how many eval results were new."""
        new = 0
        for event in self._tail.read():
            success = event.attrs.get("mean_success")
            if event.kind != "rollout.eval" or event.weight_version is None \
                    or not isinstance(success, int | float):
                continue
            if self._stats.record_eval(event.weight_version, float(success)):
                new += 1
                log.info("held-out eval at weight version %d: success %.3f",
                         event.weight_version, success)
        return new

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_loop, name="eval-follower",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._tail.close()

    def _run_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll_once()
            except redis.RedisError as exc:  # Redis restarting: try again next time
                log.debug("reading eval events failed: %s", exc)
