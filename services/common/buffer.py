"""The sample buffer: finished groups wait in a Redis stream until the trainer has used them.

Keys, for run name `<run>`:
- `riptide:<run>:samples`: the stream, one entry per group (fields `group`: a serialized
  `common_pb2.Group`, `group_id`), read through the consumer group `trainer`.
- `riptide:<run>:group:<group_id>`: marks a group id as written, for `dedup_ttl_s`, so that a
  producer retry never writes a group twice.
- `riptide:<run>:weight_version`: the last weight version the engines committed (written by
  the rollout service, read back when it restarts).

Full means: the stream holds `max_groups` entries. Acknowledging an entry (after the step
that used it is checkpointed) also deletes it, so that count is exactly the groups written
and not yet acknowledged, unread or pending; a group read but not acknowledged still takes
its slot. The check and the write are one round trip; producers racing for the last free
slot can each get it, so with N concurrent producers the stream holds at most
max_groups + N - 1.

Each entry is delivered to one consumer; one that dies leaves its entries pending until
`reclaim` hands them to another; `ack` reports how many entries this call acknowledged, so
a group is counted once. The rollout service writes with `AsyncSampleBuffer.put`; the
trainer reads, acknowledges and reclaims with `SampleBuffer`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from services._proto.riptide.v1.common_pb2 import Group
from services.common.config import RedisConfig
from services.common.errors import Backpressure, InvalidRequest, Unauthenticated, Unavailable
from services.common.redis_connect import connect, connect_async

CONSUMER_GROUP = "trainer"
DEDUP_TTL_S = 24 * 3600  # producer retries come within minutes; markers cost ~100 B each
Entry = tuple[str, Group]

# Runs between WATCH and MULTI. It never writes the payload (a megabyte through Lua costs
# several copies); it only touches the watched marker to make EXEC abort when the group is a
# duplicate or the stream is full.
_GATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SET', KEYS[1], '1', 'XX', 'KEEPTTL')
  return 0
end
if redis.call('XLEN', KEYS[2]) >= tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1')
  redis.call('DEL', KEYS[1])
  return -1
end
return 1
"""
# Deletes only what this call acknowledged: never an unread entry, never one acked elsewhere.
_ACK = """
local n = 0
for _, id in ipairs(ARGV) do
  if redis.call('XACK', KEYS[1], 'trainer', id) == 1 then
    redis.call('XDEL', KEYS[1], id)
    n = n + 1
  end
end
return n
"""
_NEW, _DUP, _FULL = 1, 0, -1


@dataclass(frozen=True)
class BufferStats:
    """Depth of the buffer: `length` unacknowledged groups, `pending` of them being read."""

    length: int
    pending: int
    max_groups: int

    @property
    def unread(self) -> int:
        return self.length - self.pending


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class _BufferBase:
    """Key names, the put protocol and error translation, shared by both clients."""

    def __init__(self, config: RedisConfig, run: str, dedup_ttl_s: int) -> None:
        self.config = config
        self.run = run
        self.stream = f"riptide:{run}:samples"
        self._marker_prefix = f"riptide:{run}:group:"
        self.version_key = f"riptide:{run}:weight_version"
        self._dedup_ttl_s = dedup_ttl_s
        self._url = redact(config.url)

    def _client_options(self) -> dict[str, Any]:
        # A hung or partitioned server fails within connect_timeout_s of silence too; a
        # blocking read extends that by its block time (see SampleBuffer.read). One retry
        # reconnects a pooled connection that went stale.
        return {
            "socket_connect_timeout": self.config.connect_timeout_s,
            "socket_timeout": self.config.connect_timeout_s,
            "socket_read_size": 1 << 20,
            "protocol": 2,  # the raw replies parsed here are RESP2
        }

    def _put_commands(self, group_id: str, payload: bytes) -> list[tuple[Any, ...]]:
        """WATCH marker, gate, MULTI, XADD, mark, EXEC: one round trip, atomic, conditional."""
        if not group_id:
            raise InvalidRequest("a group needs a group_id: it is what makes put idempotent")
        marker = self._marker_prefix + group_id
        return [
            ("WATCH", marker),
            ("EVAL", _GATE, 2, marker, self.stream, self.config.max_groups),
            ("MULTI",),
            ("XADD", self.stream, "*", "group", payload, "group_id", group_id),
            ("SET", marker, "1", "EX", self._dedup_ttl_s),
            ("EXEC",),
        ]

    @staticmethod
    def _outcome(replies: list[Any]) -> int | None:
        """_NEW, _DUP, _FULL, or None when a concurrent put of the same id won the race."""
        gate, committed = replies[1], replies[-1]
        if committed is not None:
            for reply in committed:
                if isinstance(reply, Exception):
                    raise reply
            return _NEW
        return None if gate == _NEW else int(gate)

    def _backpressure(self, timeout_s: float) -> Backpressure:
        return Backpressure(
            f"sample buffer {self.stream} at {self._url} holds max_groups="
            f"{self.config.max_groups} unacknowledged groups; still full after {timeout_s}s"
        )

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except redis.AuthenticationError as exc:  # NOAUTH, WRONGPASS: retrying cannot help
            raise Unauthenticated(
                f"Redis at {self._url} refused user {self.config.username!r} ({exc}): set "
                "redis.password (or RIPTIDE_REDIS_PASSWORD) to the deployment's password"
            ) from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(
                f"cannot reach Redis at {self._url} ({exc}); start it with `redis-server` "
                "(or `riptide up`), or set [redis] url to a running server"
            ) from exc

    @staticmethod
    def _ignore_busygroup(exc: redis.ResponseError) -> None:
        if not str(exc).startswith("BUSYGROUP"):
            raise exc


def _polls(deadline: float) -> Iterator[float]:
    """Sleeps between polls while a full buffer drains: 1 ms doubling to 20 ms, until deadline."""
    delay = 0.001
    while (left := deadline - time.monotonic()) > 0:
        yield min(delay, left)
        delay = min(delay * 2, 0.02)


def payloads(entries: Sequence[Any]) -> list[tuple[str, bytes]]:
    """Raw stream entries `[id, [field, value, ...]]` -> (entry_id, serialized group); entries
    deleted while pending come back as nil and are skipped."""
    out = []
    for entry in entries:
        if entry and entry[1]:
            fields = entry[1]
            out.append((entry[0].decode(), fields[fields.index(b"group") + 1]))
    return out


def decode(entries: list[tuple[str, bytes]]) -> list[Entry]:
    """(entry_id, serialized group) -> (entry_id, Group)."""
    return [(entry_id, Group.FromString(payload)) for entry_id, payload in entries]


class SampleBuffer(_BufferBase):
    """Synchronous client: the trainer's read, ack and reclaim, and a blocking put."""

    def __init__(self, config: RedisConfig, run: str, dedup_ttl_s: int = DEDUP_TTL_S) -> None:
        super().__init__(config, run, dedup_ttl_s)
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self._client = connect(config, retry=retry, **self._client_options())
        with self._guard():
            try:
                self._client.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                self._ignore_busygroup(exc)
        self._ack_script = self._client.register_script(_ACK)

    def put(self, group: Group, timeout_s: float = 60.0) -> bool:
        """Write a group once; False if its group_id was already written. Waits while the
        buffer is full and raises Backpressure after `timeout_s`."""
        return self.put_serialized(group.group_id, group.SerializeToString(), timeout_s)

    def put_serialized(self, group_id: str, payload: bytes, timeout_s: float = 60.0) -> bool:
        """`put` of a group already serialized (`payload` must parse as a Group)."""
        commands = self._put_commands(group_id, payload)
        deadline = time.monotonic() + timeout_s
        with self._guard():
            while True:
                outcome = self._outcome(self._transact(commands))
                if outcome == _NEW or outcome == _DUP:
                    return outcome == _NEW
                if outcome == _FULL and not self._wait_for_space(deadline):
                    raise self._backpressure(timeout_s)

    def _transact(
        self, commands: list[tuple[Any, ...]], timeout_s: float | None = None
    ) -> list[Any]:
        pool = self._client.connection_pool
        conn = pool.get_connection()
        timeout = self.config.connect_timeout_s if timeout_s is None else timeout_s
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            return [conn.read_response(timeout=timeout) for _ in commands]
        except BaseException:
            conn.disconnect()  # unread replies or a WATCH may be left on it
            raise
        finally:
            pool.release(conn)

    def _wait_for_space(self, deadline: float) -> bool:
        for delay in _polls(deadline):
            if self._client.xlen(self.stream) < self.config.max_groups:
                return True
            time.sleep(delay)
        return False

    def read(self, consumer: str, count: int = 1, block_ms: int = 0) -> list[Entry]:
        """Up to `count` groups never delivered before, as (entry_id, group); waits up to
        `block_ms` for the first one (0: return at once). Ack them once committed."""
        return decode(self.read_serialized(consumer, count, block_ms))

    def read_serialized(
        self, consumer: str, count: int = 1, block_ms: int = 0
    ) -> list[tuple[str, bytes]]:
        """`read` without parsing, for consumers that parse elsewhere (a loader process)."""
        command: tuple[Any, ...] = ("XREADGROUP", "GROUP", CONSUMER_GROUP, consumer, "COUNT", count)
        if block_ms > 0:
            command += ("BLOCK", block_ms)
        command += ("STREAMS", self.stream, ">")
        timeout_s = self.config.connect_timeout_s + block_ms / 1000
        with self._guard():
            (reply,) = self._transact([command], timeout_s)
        return payloads(reply[0][1]) if reply else []

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over up to `count` groups that another (dead) consumer read but did not ack
        within `min_idle_ms`; choose it longer than a training step."""
        entries: list[Entry] = []
        cursor: bytes = b"0-0"
        with self._guard():
            while len(entries) < count:
                command = ("XAUTOCLAIM", self.stream, CONSUMER_GROUP, consumer, min_idle_ms,
                           cursor, "COUNT", count - len(entries))  # fmt: skip
                ((cursor, claimed, *_),) = self._transact([command])
                entries.extend(decode(payloads(claimed)))
                if cursor == b"0-0":
                    break
        return entries

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge and delete entries; returns how many were acknowledged by this call
        (an entry already acknowledged, or never read, counts 0 and is left alone)."""
        if not entry_ids:
            return 0
        with self._guard():
            return int(self._ack_script(keys=[self.stream], args=list(entry_ids)))

    def stats(self) -> BufferStats:
        """Stream length (unacknowledged groups) and pending (read, not yet acknowledged)."""
        with self._guard():
            pipe = self._client.pipeline(transaction=False)
            pipe.xlen(self.stream)
            pipe.xpending(self.stream, CONSUMER_GROUP)
            length, pending = pipe.execute()
        return BufferStats(int(length), int(pending["pending"]), self.config.max_groups)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SampleBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSampleBuffer(_BufferBase):
    """asyncio client for producers: `buffer = await AsyncSampleBuffer.connect(config, run)`."""

    def __init__(self, config: RedisConfig, run: str, dedup_ttl_s: int = DEDUP_TTL_S) -> None:
        super().__init__(config, run, dedup_ttl_s)
        retry = AsyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self._client = connect_async(config, retry=retry, **self._client_options())

    @classmethod
    async def connect(
        cls, config: RedisConfig, run: str, dedup_ttl_s: int = DEDUP_TTL_S
    ) -> AsyncSampleBuffer:
        """A client whose stream and consumer group exist (created if needed)."""
        buffer = cls(config, run, dedup_ttl_s)
        with buffer._guard():
            try:
                await buffer._client.xgroup_create(
                    buffer.stream, CONSUMER_GROUP, id="0", mkstream=True
                )
            except redis.ResponseError as exc:
                buffer._ignore_busygroup(exc)
        return buffer

    async def put(self, group: Group, timeout_s: float = 60.0) -> bool:
        """Write a group once; False if its group_id was already written. Waits while the
        buffer is full and raises Backpressure after `timeout_s`."""
        return await self.put_serialized(group.group_id, group.SerializeToString(), timeout_s)

    async def put_serialized(self, group_id: str, payload: bytes, timeout_s: float = 60.0) -> bool:
        """`put` of a group already serialized (`payload` must parse as a Group)."""
        commands = self._put_commands(group_id, payload)
        deadline = time.monotonic() + timeout_s
        with self._guard():
            while True:
                outcome = self._outcome(await self._transact(commands))
                if outcome == _NEW or outcome == _DUP:
                    return outcome == _NEW
                if outcome == _FULL and not await self._wait_for_space(deadline):
                    raise self._backpressure(timeout_s)

    async def _transact(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            return await self._send(commands)
        except (
            redis.ConnectionError
        ):  # a pooled connection may have gone stale; puts are idempotent
            return await self._send(commands)

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pool = self._client.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(commands))
            return [await conn.read_response() for _ in commands]
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def _wait_for_space(self, deadline: float) -> bool:
        for delay in _polls(deadline):
            if await self._client.xlen(self.stream) < self.config.max_groups:
                return True
            await asyncio.sleep(delay)
        return False

    async def stats(self) -> BufferStats:
        """Stream length (unacknowledged groups) and pending (read, not yet acknowledged)."""
        with self._guard():
            pipe = self._client.pipeline(transaction=False)
            pipe.xlen(self.stream)
            pipe.xpending(self.stream, CONSUMER_GROUP)
            length, pending = await pipe.execute()
        return BufferStats(int(length), int(pending["pending"]), self.config.max_groups)

    async def set_weight_version(self, version: int) -> None:
        """Record the weight version the engines committed (never moves backwards)."""
        with self._guard():
            current = await self._client.get(self.version_key)
            if current is None or int(current) < version:
                await self._client.set(self.version_key, version)

    async def weight_version(self) -> int | None:
        """The last committed weight version of this run, if one was recorded."""
        with self._guard():
            value = await self._client.get(self.version_key)
        return int(value) if value is not None else None

    async def aclose(self) -> None:
        await self._client.aclose()
