"""The run's events: phase spans every service publishes for the dashboard, and how to read them.

Two capped Redis streams per run (`XADD ... MAXLEN ~ cap`):
- `riptide:<run>:events`: one field `event`, a JSON `Event` (kinds and their attrs below);
- `riptide:<run>:episodes`: one field `episode`, the JSON detail of one finished episode for
  the per-sample view (`EPISODE_FIELDS`), written by the sandbox service, which holds the
  tokenizer and the turns' text.

`EventPublisher` is what services call: `publish()` only appends to a bounded in-memory queue
and one background thread writes batches with pipelined XADDs, so the hot path never waits
on Redis. When the queue is full or Redis is down the event is dropped and counted in
`riptide_events_dropped_total`; samples never travel this way, so nothing else is lost.
A finished run is saved with `export_events` (JSONL) and reopened with `load_events`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.config import EventsConfig, RedisConfig
from services.common.errors import InvalidRequest
from services.common.metrics import counter
from services.common.redis_connect import connect

log = logging.getLogger(__name__)

Service = Literal["trainer", "rollout", "sandbox", "router"]

#: Every kind, and the attrs its events carry (an instant has end == start).
KINDS: dict[str, str] = {
    "trainer.step": "span of one optimizer step (forward, backward, update; checkpoint and "
                    "sync are their own spans); weight_version is the one trained from: step, "
                    "reward_mean, success_rate (share of rewards >= 1), groups, samples, "
                    "tokens, tokens_per_s, loss, mismatch_kl, staleness (list, one per trained "
                    "sample: weight versions between its group's oldest token and the trained "
                    "version), idle_fraction (this cycle's wait for data over wait + step + "
                    "checkpoint + sync)",
    "trainer.wait_data": "span the trainer waited for a batch: groups (how many it got), "
                         "warmup (the process's first wait, engines starting included)",
    "trainer.checkpoint": "span of a checkpoint save and its stream acks: step",
    "trainer.group_dropped": "instant: a group read but not trained: group_id, reason (stale)",
    "trainer.weight_sync": "span of a whole weight push, retries included; weight_version is "
                           "the new one: bytes, buckets (null when the push was given up)",
    "trainer.weight_sync.bucket": "span of one bucket's broadcast (id version/index): index, "
                                  "bytes",
    "rollout.engine_pause": "span an engine was paused (pause..resume; id the engine URL): "
                            "engine, reason (weight_update), outcome (committed, abandoned, "
                            "no_buckets)",
    "rollout.episode": "span of one episode, submit..trajectory (id the sample id); "
                       "weight_version the rollout's when it ended: sample_id, group_id, "
                       "task_id, engine, dp_rank (of its last turn), turns, prompt_tokens, "
                       "response_tokens (of the trajectory), segments (1, or more for an "
                       "agent behind the gateway), engine_prompt_tokens and "
                       "cached_tokens (summed over its turns as the engine reported them), "
                       "reward (null without verdict), verdict (scored, no_verdict, ...), "
                       "finish_reason, weight_versions (distinct, sorted), truncated "
                       "(context_length, max_turns or wall_time), aborted (an engine aborted "
                       "a turn), message (why no verdict), no_verdict_cause (null when "
                       "scored, else a name of services/common/no_verdict.py: "
                       "provider_create_failed, sandbox_lost, agent_timeout, agent_error, "
                       "context_overflow, verifier_error, verifier_timeout, engine_error), "
                       "eval (bool), seconds (where the sandbox service saw its time go: "
                       "queued, create, generate, commands, verify, total)",
    "rollout.group_dropped": "instant (id the group id): group_id, reason (stale, no_verdict, "
                             "zero_variance, rejected_duplicate_id), samples",
    "rollout.eval": "span of one evaluation, first episode..last: weight_version, "
                    "mean_success, per_task ({task: success})",
    "rollout.load": "instant, about every second: in_flight, cap, engines (list of {engine, "
                    "dp_rank, state (fleet), running, waiting, in_flight (router calls), "
                    "prompt_tokens, cached_tokens (both cumulative over the calls the router "
                    "routed there, from the engine's meta_info), healthy, weight_version, "
                    "circuit (open or closed)})",
    "sandbox.create": "span of a sandbox creation (id the sample id): task_id, sandbox, "
                      "error (type, when it failed)",
    "sandbox.delete": "span of a sandbox deletion (id the sandbox id): sandbox, task_id, ok",
    "sandbox.live": "instant, when a sandbox service's live sandboxes changed (checked every "
                    "sandbox.live_snapshot_interval_s) and at least every "
                    "live_snapshot_heartbeat_s (id the service instance, host:pid): instance, "
                    "heartbeat_s, num_live, sandboxes (the oldest 500 of them, oldest first: "
                    "{sandbox (empty while creating), "
                    "task_id, provider, sample_id, group_id (empty once the episode is gone), "
                    "turns, state (creating, running, verifying, deleting), age_s (since the "
                    "sandbox was created; since its create began while creating)}); and the "
                    "lifecycle figures of that process: incarnation, service_instance, "
                    "num_alive, num_leased (lease held and unexpired), num_reaped, "
                    "num_delete_failures (episodes' and the reaper's), lease_renew_failures, "
                    "reaping (bool: the provider lists its sandboxes)",
    "sandbox.reap": "span of the reaper deleting an orphaned sandbox of the run (id the sandbox "
                    "id): sandbox, reason (incarnation_gone, lease_lapsed, run_end), "
                    "incarnation (the sandbox's), task_id, ok",
    "sandbox.verify": "span of the verifier (id the sample id): task_id, passed (reward >= 1), "
                      "scored, reward, exit_code (of tests/test.sh; null when it timed out)",
}

#: Fields of an `riptide:<run>:episodes` entry (services/sandbox/episode_detail.py).
#: `turns`: [{assistant, commands, observation}]; `tokens`: {ids, loss_mask, logprobs} over
#: prompt then response (mask 0 and log-prob 0 on the prompt, the first num_prompt_tokens);
#: `token_text`: each token decoded on its own by the sandbox's tokenizer, special tokens
#: kept, so the dashboard needs no engine. Observations are cut to OBSERVATION_MAX_CHARS.
EPISODE_FIELDS = ("sample_id", "group_id", "task_id", "reward", "verdict", "message",
                  "finish_reason", "engine", "dp_rank", "turns", "num_prompt_tokens", "tokens",
                  "token_text")
OBSERVATION_MAX_CHARS = 4000
WRITE_BATCH = 512  # events the writer thread takes off the queue per pipelined write

_dropped = counter("riptide_events_dropped_total",
                   "events dropped because the queue was full or Redis was unreachable",
                   ["reason"])
_published = counter("riptide_events_published_total", "events written to Redis")


class Event(BaseModel):
    """One entry of `riptide:<run>:events`."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="one of KINDS (others are kept, for forward compatibility)")
    service: Service
    start: float = Field(description="unix seconds")
    end: float = Field(description="unix seconds; == start for an instant")
    id: str = Field("", description="the sample, group, step or bucket id")
    weight_version: int | None = None
    attrs: dict[str, Any] = Field(default_factory=dict)


def events_key(run: str) -> str:
    return f"riptide:{run}:events"


def episodes_key(run: str) -> str:
    return f"riptide:{run}:episodes"


_Item = tuple[str, str, Any]  # (stream key, field, dict or a callable building it)


class EventPublisher:
    """Publishes one service's events; `publish()` never blocks and never raises."""

    def __init__(self, redis: RedisConfig, run: str, service: Service, config: EventsConfig,
                 connect_timeout_s: float = 1.0, retry_after_s: float = 1.0) -> None:
        self.service = service
        self.config = config
        self.enabled = config.enabled
        self._events_key, self._episodes_key = events_key(run), episodes_key(run)
        self._redis = redis
        self._connect_timeout_s = connect_timeout_s
        self._retry_after_s = retry_after_s
        self._queue: deque[_Item] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    @classmethod
    def disabled(cls, service: Service) -> EventPublisher:
        """A publisher that drops nothing and writes nothing (events off, or in tests)."""
        return cls(RedisConfig(), "", service, EventsConfig(enabled=False))

    def publish(self, kind: str, *, id: str = "", start: float | None = None,
                end: float | None = None, weight_version: int | None = None,
                attrs: dict[str, Any] | None = None) -> None:
        """Queue one event; `start` defaults to now, `end` to `start` (an instant)."""
        if not self.enabled:
            return
        start = time.time() if start is None else start
        event = {"kind": kind, "service": self.service, "start": start,
                 "end": start if end is None else end, "id": id,
                 "weight_version": weight_version, "attrs": attrs or {}}
        self._put((self._events_key, "event", event))

    @contextmanager
    def span(self, kind: str, *, id: str = "", weight_version: int | None = None,
             attrs: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Publish a span around the block; the block may add attrs to the yielded dict."""
        extra: dict[str, Any] = dict(attrs or {})
        start = time.time()
        try:
            yield extra
        finally:
            self.publish(kind, id=id, start=start, end=time.time(),
                         weight_version=weight_version, attrs=extra)

    def publish_episode(self, build: Callable[[], dict[str, Any]]) -> None:
        """Queue one episode's detail; `build` runs on the writer thread, off the hot path."""
        if self.enabled:
            self._put((self._episodes_key, "episode", build))

    def _put(self, item: _Item) -> None:
        if len(self._queue) >= self.config.queue_size:
            self._drop("queue_full")
            return
        self._queue.append(item)
        if self._thread is None:
            self._start()

    def _drop(self, reason: str, count: int = 1) -> None:
        self.dropped += count
        _dropped.labels(reason).inc(count)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                                name=f"events-{self.service}")
                self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the writer thread."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)

    def _write_loop(self) -> None:
        client = connect(
            self._redis, socket_connect_timeout=self._connect_timeout_s,
            socket_timeout=max(self._connect_timeout_s, 5.0), protocol=2)
        failing = False
        while not (self._closing and not self._queue):
            self._wake.wait(0.05)
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), WRITE_BATCH))]
            if not batch:
                continue
            try:
                self._write(client, batch)
                if failing:
                    failing = False
                    log.info("events are written again", extra={"dropped": self.dropped})
            except Exception as exc:  # noqa: BLE001 - a publisher never takes its service down
                self._drop("redis_unavailable", len(batch))
                if not failing:  # once per outage, not once per batch
                    failing = True
                    log.warning("events not written; dropping them until Redis answers",
                                extra={"error": str(exc)[:200]})
                if self._closing:
                    self._drop("redis_unavailable", len(self._queue))
                    self._queue.clear()
                    break
                time.sleep(self._retry_after_s)
        client.close()

    def _write(self, client: redis.Redis, batch: list[_Item]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, field, payload in batch:
            data = payload() if callable(payload) else payload
            cap = (self.config.episodes_max_len if key == self._episodes_key
                   else self.config.max_len)
            pipe.xadd(key, {field: json.dumps(data, default=str)}, maxlen=cap,
                      approximate=True)
        pipe.execute()
        _published.inc(len(batch))


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_events(entries: list[tuple[Any, dict[Any, Any]]]) -> list[tuple[str, Event]]:
    """XRANGE entries of the events stream as (entry id, Event); malformed ones are skipped."""
    out = []
    for entry_id, fields in entries:
        raw = fields.get(b"event", fields.get("event")) or b""
        try:
            out.append((_decode(entry_id), Event.model_validate_json(raw)))
        except (ValidationError, TypeError, ValueError):
            log.warning("skipped a malformed event", extra={"entry": _decode(entry_id)})
    return out


def _range(client: redis.Redis, key: str, since_id: str, count: int) -> list[Any]:
    start = "-" if since_id in ("", "0", "0-0") else f"({since_id}"
    return list(client.xrange(key, start, "+", count=count))  # type: ignore[arg-type]


def _episode(entry_id: Any, fields: dict[Any, Any]) -> dict[str, Any] | None:
    try:
        value = json.loads(fields.get(b"episode", fields.get("episode")) or b"")
    except (TypeError, ValueError):
        log.warning("skipped a malformed episode", extra={"entry": _decode(entry_id)})
        return None
    return value if isinstance(value, dict) else None


def stream_id_before(unix_ms: int) -> str:
    """The greatest stream id before millisecond `unix_ms`: a tail started from it reads every
    entry added at or after that millisecond (Redis numbers an entry by the millisecond it was
    added, so one added in that very millisecond is `<unix_ms>-0`, which a cursor of
    `<unix_ms>-0` would skip)."""
    return f"{unix_ms - 1}-{2**64 - 1}"


def read_events(client: redis.Redis, run: str, since_id: str = "0-0",
                count: int = 10_000) -> list[tuple[str, Event]]:
    """Up to `count` events after entry `since_id` (all from the start with "0-0")."""
    return parse_events(_range(client, events_key(run), since_id, count))


class EventTail:
    """Follows one run's events stream: each `read()` returns the events after the last."""

    def __init__(self, redis: RedisConfig, run: str, since_id: str = "0-0",
                 page: int = 1000) -> None:
        self._client = connect(redis, socket_connect_timeout=1.0, socket_timeout=5.0)
        self._run = run
        self._cursor = since_id
        self._page = page

    def read(self) -> list[Event]:
        """Every event since the last read, page by page; a Redis error after some pages
        returns those (the rest comes next time), before any it is raised."""
        out: list[Event] = []
        while True:
            try:
                entries = read_events(self._client, self._run, self._cursor, self._page)
            except redis.RedisError:
                if out:
                    return out
                raise
            if not entries:
                return out
            self._cursor = entries[-1][0]
            out.extend(event for _, event in entries)

    def close(self) -> None:
        self._client.close()


def read_episodes(client: redis.Redis, run: str, since_id: str = "0-0",
                  count: int = 1000) -> list[tuple[str, dict[str, Any]]]:
    """Up to `count` episode details after entry `since_id`."""
    out = []
    for entry_id, fields in _range(client, episodes_key(run), since_id, count):
        if (value := _episode(entry_id, fields)) is not None:
            out.append((_decode(entry_id), value))
    return out


def _pages(client: redis.Redis, key: str, chunk: int) -> Iterator[list[Any]]:
    since = "0-0"
    while entries := _range(client, key, since, chunk):
        since = _decode(entries[-1][0])
        yield entries


def iter_events(client: redis.Redis, run: str, chunk: int = 5000) -> Iterator[Event]:
    """Every event of the run, oldest first, read `chunk` entries at a time."""
    for entries in _pages(client, events_key(run), chunk):
        yield from (event for _, event in parse_events(entries))


def export_events(client: redis.Redis, run: str, out: str | Path,
                  chunk: int = 5000) -> tuple[int, int]:
    """Write the run's events and episode details to a JSONL file, oldest first: lines
    `{"entry_id", "event"}` then `{"entry_id", "episode"}`. Returns both counts."""
    counts = {"event": 0, "episode": 0}
    with Path(out).open("w") as sink:
        for name, key in (("event", events_key(run)), ("episode", episodes_key(run))):
            for entries in _pages(client, key, chunk):
                items = (parse_events(entries) if name == "event" else
                         [(_decode(i), v) for i, f in entries
                          if (v := _episode(i, f)) is not None])
                for entry_id, item in items:
                    value = item.model_dump() if isinstance(item, Event) else item
                    sink.write(json.dumps({"entry_id": entry_id, name: value}) + "\n")
                counts[name] += len(items)
    return counts["event"], counts["episode"]


def _lines(path: str | Path, name: str) -> Iterator[tuple[int, Any]]:
    with Path(path).open() as source:
        for number, line in enumerate(source, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    raise InvalidRequest(f"{path}:{number}: not a JSON line") from None
                if isinstance(record, dict) and name in record:
                    yield number, record[name]


def load_events(path: str | Path) -> list[Event]:
    """The events of a file written by `export_events`."""
    events = []
    for number, value in _lines(path, "event"):
        try:
            events.append(Event.model_validate(value))
        except ValidationError as exc:
            raise InvalidRequest(
                f"{path}:{number}: not an event: {exc.errors()[0]['msg']}") from None
    return events


def load_episodes(path: str | Path) -> list[dict[str, Any]]:
    """The episode details of a file written by `export_events`."""
    return [value for _, value in _lines(path, "episode")]
