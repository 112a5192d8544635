"""The trainer's side of the sample stream: recover after a restart, then read whole batches.

`GroupStream` reads groups through `SampleBuffer` as one consumer of the consumer group
`trainer`, `rollout_batch_size` groups per batch, blocking in XREADGROUP while the stream is
empty (never polling), and records that blocked time as the batch's `wait_s` (bubble).
It never acknowledges what it trains: loop.py acks entries once the checkpoint covering them
is durable. After a restart, `recover()` acks what the last checkpoint covers and re-reads
every other pending entry (XAUTOCLAIM) ahead of new ones, so no group is skipped and none is
trained twice. Redis going away (a restart) pauses reading and acking until it is back
(`REDIS_PATIENCE_S`), keeping the entries already read. A `reject` callable may leave a group
out of the batch with a reason (too stale); such entries are handed back by `take_rejected`
for the loop to record and ack with its next checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from services._proto.riptide.v1.common_pb2 import Group
from services.common.buffer import SampleBuffer
from services.common.errors import Unavailable
from services.trainer.data.batch import RolloutBatch, pack_groups

_RECLAIM_ALL = 1 << 30
#: How long a read, ack or reclaim waits for an unreachable Redis before the error surfaces.
REDIS_PATIENCE_S = 300.0
_T = TypeVar("_T")
log = logging.getLogger(__name__)


def _patiently(call: Callable[[], _T], what: str) -> _T:
    """`call()`, retried every second while Redis is unreachable, for REDIS_PATIENCE_S."""
    deadline = time.monotonic() + REDIS_PATIENCE_S
    while True:
        try:
            return call()
        except Unavailable as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("%s: Redis unreachable, retrying: %s", what, exc)
            time.sleep(1.0)


@dataclass(frozen=True)
class Recovery:
    """What `recover()` found in the stream."""

    acked_covered: int
    skipped_trained: int
    requeued: int


class GroupStream:
    """Batches of groups from the Redis sample stream, for a single trainer consumer."""

    def __init__(
        self,
        buffer: SampleBuffer,
        consumer: str,
        rollout_batch_size: int,
        normalize_std: bool,
        max_tokens_per_microbatch: int,
        block_ms: int = 1000,
        pad_id: int = 0,
        packed: bool = False,
        shared_prefix: bool = False,
    ) -> None:
        self.buffer = buffer
        self.consumer = consumer
        self.rollout_batch_size = rollout_batch_size
        self.normalize_std = normalize_std
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.block_ms = block_ms
        self.pad_id = pad_id
        self.packed = packed
        self.shared_prefix = shared_prefix
        self._backlog: deque[tuple[str, Group]] = deque()
        self._rejected: list[tuple[str, str, str]] = []
        self.total_wait_s = 0.0

    def recover(self, covered_entry_ids: Iterable[str], trained_group_ids: set[str]) -> Recovery:
        """Ack entries the checkpoint covers; queue every other pending entry to be read first.

        The trainer is the stream's only consumer, so every pending entry at start-up belongs
        to a previous incarnation of it and is claimed at once (min idle 0).
        """
        covered = list(covered_entry_ids)
        acked = _patiently(lambda: self.buffer.ack(covered), "ack on recovery")
        skipped: list[str] = []
        pending = _patiently(lambda: self.buffer.reclaim(self.consumer, 0, _RECLAIM_ALL),
                             "reclaim on recovery")
        for entry_id, group in pending:
            if group.group_id in trained_group_ids:
                skipped.append(entry_id)
            else:
                self._backlog.append((entry_id, group))
        self.ack(skipped)
        return Recovery(acked, len(skipped), len(self._backlog))

    def ack(self, entry_ids: list[str]) -> int:
        """Acknowledge (and delete) entries whose training is durably checkpointed."""
        return _patiently(lambda: self.buffer.ack(entry_ids), "ack")

    def take_rejected(self) -> list[tuple[str, str, str]]:
        """(entry_id, group_id, reason) of groups `reject` left out since the last call."""
        out, self._rejected = self._rejected, []
        return out

    def next_batch(
        self,
        should_stop: Callable[[], bool],
        trained_group_ids: set[str],
        reject: Callable[[Group], str | None] | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> RolloutBatch | None:
        """The next `rollout_batch_size` groups, packed; None when asked to stop first.

        Entries whose group id was already trained (a producer duplicate) are acked and left
        out; so are groups `reject` names a reason for (kept for `take_rejected`, not acked).
        Waits in blocking reads of at most `block_ms` so that a stop is seen promptly, and
        calls `while_waiting` between them.
        """
        entries: list[tuple[str, Group]] = []
        seen: set[str] = set()
        wait_s = 0.0
        while len(entries) < self.rollout_batch_size:
            if self._backlog:
                fresh = [self._backlog.popleft()]
            else:
                if should_stop():
                    self._backlog.extendleft(reversed(entries))
                    return None
                if while_waiting is not None:
                    while_waiting()
                start = time.monotonic()
                fresh = _patiently(
                    partial(self.buffer.read, self.consumer,
                            self.rollout_batch_size - len(entries), self.block_ms), "read")
                wait_s += time.monotonic() - start
            duplicates = []
            for entry_id, group in fresh:
                if group.group_id in trained_group_ids or group.group_id in seen:
                    duplicates.append(entry_id)
                elif reject is not None and (reason := reject(group)) is not None:
                    self._rejected.append((entry_id, group.group_id, reason))
                    seen.add(group.group_id)
                else:
                    seen.add(group.group_id)
                    entries.append((entry_id, group))
            self.ack(duplicates)
        batch = pack_groups(
            entries, self.normalize_std, self.max_tokens_per_microbatch, self.pad_id,
            self.packed, self.shared_prefix,
        )
        batch.wait_s = wait_s
        self.total_wait_s += wait_s
        return batch
