"""The weight-update coordinator behind `Rollout.UpdateWeights` (called by the trainer).

Per update: pause every engine that is up (configured mode), make sure each is in the
trainer's weight-update group (formed again whenever the set of engines changed or one of
them never joined: world size 1 + all engine ranks, rank offsets assigned here in fleet
order), forward each bucket's metadata to every engine while the trainer broadcasts it, then
set the new version on the engines and the router, register engines that waited for these
weights, tell the scheduler, and continue generation. A failure (or a trainer that leaves)
once a bucket may have been loaded names every engine and step that failed and leaves no
engine paused: their weights may be mixed, so they leave the router, continue (nothing is
routed to them) and wait for the next update, which forms the group again, sends every weight
and registers them again. The trainer retries, and asks for that update when it is idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services._proto.riptide.v1 import rollout_pb2 as pb
from services.common.errors import Conflict, InvalidRequest, RiptideError, Unavailable
from services.rollout.config import WeightUpdateConfig
from services.rollout.fleet import EngineFleet, EngineMember
from services.rollout.run_events import RolloutEvents
from services.rollout.scheduler_stats import Histogram
from services.rollout.weight_update_requests import check_begin, check_bucket

log = logging.getLogger(__name__)


class WeightUpdateFailed(RiptideError):
    """A weight update failed part-way; the message says which engines, at which step."""

    grpc_code = grpc.StatusCode.ABORTED
    http_status = 409


class WeightUpdateCoordinator:
    """Runs one weight update at a time over the fleet's engines."""

    def __init__(self, fleet: EngineFleet, config: WeightUpdateConfig,
                 on_committed: Callable[[int], None],
                 events: RolloutEvents | None = None) -> None:
        self.fleet = fleet
        self.events = events or RolloutEvents()
        self.config = config
        self._on_committed = on_committed
        self._busy = asyncio.Lock()
        self._group_key: tuple[Any, ...] | None = None
        self.engines_paused = False
        self.abandoned = 0  # updates given up after weights moved
        self._members: list[EngineMember] = []
        self.history: deque[dict[str, Any]] = deque(maxlen=50)
        self.durations_s = Histogram((0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))

    def state(self) -> dict[str, Any]:
        return {"in_progress": self._busy.locked(), "engines_paused": self.engines_paused,
                "group_formed": self._group_key is not None, "abandoned": self.abandoned,
                "recent": list(self.history)[-5:]}

    async def run(self, requests: AsyncIterator[pb.WeightUpdateRequest]
                  ) -> AsyncIterator[pb.WeightUpdateEvent]:
        """Serve one UpdateWeights stream: Begin, Bucket..., Commit."""
        first = await anext(requests, None)
        if first is None or first.WhichOneof("step") != "begin":
            raise InvalidRequest("UpdateWeights must start with a Begin message")
        check_begin(first.begin)  # before the lock is taken or an engine paused
        if self._busy.locked():
            raise Conflict("another weight update is in progress")
        begin = first.begin
        loop = asyncio.get_running_loop()
        record: dict[str, Any] = {"weight_version": begin.weight_version, "status": "running",
                                  "buckets": 0}
        self.history.append(record)
        start = loop.time()
        async with self._busy, self.fleet.lock:
            try:
                async for event in self._update(begin, requests, record):
                    yield event
            except BaseException as exc:
                if record["status"] == "committed":  # the caller left after the answer
                    raise
                record["status"] = "failed"
                record["error"] = str(exc) or type(exc).__name__
                self._group_key = None  # the collective may be broken: form it again
                if self.engines_paused and record["buckets"] == 0:
                    # No weight moved: the engines hold the old weights intact; let them go on.
                    await asyncio.shield(self._resume_all(self._members, begin.weight_version,
                                                          "no_buckets"))
                elif self.engines_paused:  # shielded: a cancelled stream still releases them
                    await asyncio.shield(self._release(version=begin.weight_version))
                raise
            finally:
                record["duration_s"] = round(loop.time() - start, 3)
                if record["status"] == "committed":
                    self.durations_s.observe(loop.time() - start)

    async def _update(self, begin: pb.WeightUpdateBegin,
                      requests: AsyncIterator[pb.WeightUpdateRequest],
                      record: dict[str, Any]) -> AsyncIterator[pb.WeightUpdateEvent]:
        version = begin.weight_version
        client = self.fleet.client
        members = await self.fleet.update_members()
        if not members:
            raise Unavailable(f"weight update v{version}: no engine is up")
        record["engines"] = [m.url for m in members]
        self._members = members
        try:
            await self._all(version, members, "pause_generation",
                            lambda m: client.pause(m.url, self.config.pause_mode))
        except WeightUpdateFailed:  # no weight has moved: let the others generate again
            await self._resume_all(members, version, "pause_failed")
            raise
        self.engines_paused = True
        self.events.engines_paused(m.url for m in members)
        if begin.colocated:
            async for event in self._colocated(version, members, requests, record):
                yield event
            return
        world_size = 1 + sum(m.ranks for m in members)
        key = (begin.group_name, begin.master_address, begin.master_port, begin.backend,
               tuple((m.url, m.ranks) for m in members))
        if key == self._group_key and all(m.in_group for m in members):
            yield pb.WeightUpdateEvent(group=pb.WeightUpdateGroup(world_size=world_size))
        else:
            yield pb.WeightUpdateEvent(group=pb.WeightUpdateGroup(
                world_size=world_size, trainer_must_join=True))
            await self._trainer_joining(requests, version)
            await self._form_group(begin, members, world_size)
            self._group_key = key
        async for request in requests:
            step = request.WhichOneof("step")
            if step == "bucket":
                check_bucket(request.bucket, record["buckets"])  # before an engine sees it
                record["buckets"] += 1
                await self._load_bucket(version, members, begin.group_name, request.bucket)
                yield pb.WeightUpdateEvent(bucket_loaded=request.bucket.bucket_index)
            elif step == "commit":
                await self._commit(version, members)
                record["status"] = "committed"
                yield pb.WeightUpdateEvent(committed=version)
                return
            else:
                raise InvalidRequest(f"weight update v{version}: unexpected {step} mid-update")
        raise WeightUpdateFailed(
            f"weight update v{version}: the trainer ended the stream before Commit after "
            f"{record['buckets']} buckets")

    async def release_memory(self, tags: list[str]) -> pb.ReleaseEngineMemoryReply:
        """Colocated mode, before a trainer step: every engine frees the memory of `tags`
        (none: all); refused while an update runs. The next colocated update resumes it."""
        unknown = sorted(set(tags) - {"kv_cache", "weights", "cuda_graph"})
        if unknown:
            raise InvalidRequest(f"tags: unknown memory tag(s) {unknown} (known: kv_cache, "
                                 "weights, cuda_graph)")
        if self._busy.locked():
            raise Conflict("a weight update is in progress")
        async with self._busy, self.fleet.lock:
            members = await self.fleet.update_members()
            freed = await asyncio.gather(*(self.fleet.client.memory_occupation(
                m.url, "release", tags or None) for m in members))
        return pb.ReleaseEngineMemoryReply(num_engines=len(members),
                                           freed_bytes=sum(freed))

    async def _colocated(self, version: int, members: list[EngineMember],
                         requests: AsyncIterator[pb.WeightUpdateRequest],
                         record: dict[str, Any]) -> AsyncIterator[pb.WeightUpdateEvent]:
        """No group: resume the engines' weights, post each bucket's shared tensors, resume
        their KV cache, commit."""
        client = self.fleet.client
        await self._all(version, members, "resume_memory_occupation (weights)",
                        lambda m: client.memory_occupation(m.url, "resume", ["weights"]))
        yield pb.WeightUpdateEvent(group=pb.WeightUpdateGroup(world_size=0))
        async for request in requests:
            step = request.WhichOneof("step")
            if step == "bucket":
                check_bucket(request.bucket, record["buckets"], colocated=True)
                record["buckets"] += 1
                await self._load_shared_bucket(version, members, request.bucket)
                yield pb.WeightUpdateEvent(bucket_loaded=request.bucket.bucket_index)
            elif step == "commit":
                await self._all(version, members, "resume_memory_occupation (kv_cache)",
                                lambda m: client.memory_occupation(m.url, "resume", None))
                await self._commit(version, members)
                record["status"] = "committed"
                yield pb.WeightUpdateEvent(committed=version)
                return
            else:
                raise InvalidRequest(f"weight update v{version}: unexpected {step} mid-update")
        raise WeightUpdateFailed(
            f"weight update v{version}: the trainer ended the stream before Commit after "
            f"{record['buckets']} buckets")

    async def _load_shared_bucket(self, version: int, members: list[EngineMember],
                                  bucket: pb.WeightBucket) -> None:
        payload = bucket.serialized_named_tensors
        await self._all(version, members,
                        f"update_weights_from_tensor (bucket {bucket.bucket_index})",
                        lambda m: self.fleet.client.update_weights_from_tensor(m.url, payload))

    @staticmethod
    async def _trainer_joining(requests: AsyncIterator[pb.WeightUpdateRequest],
                               version: int) -> None:
        """Wait for the trainer's Joining: it has closed its earlier group's rendezvous store.
        Re-formed groups keep their name and port, so an engine sent to rendezvous before
        that could complete against the old store and wait in a group nobody broadcasts on."""
        request = await anext(requests, None)
        if request is None:
            raise WeightUpdateFailed(f"weight update v{version}: the trainer ended the stream "
                                     "before joining the group")
        step = request.WhichOneof("step")
        if step != "joining":
            raise InvalidRequest(f"weight update v{version}: expected joining after the group "
                                 f"answer said the trainer must join, got {step}")

    async def _resume_all(self, members: list[EngineMember], version: int,
                          outcome: str) -> None:
        """Let paused engines generate again; an engine that refuses is logged (the fleet's
        health checks deal with it), never left holding the update. Closes the pause spans."""
        results = await asyncio.gather(*(self.fleet.client.resume(m.url) for m in members),
                                       return_exceptions=True)
        for member, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("continue_generation on %s: %s", member.url, result)
        self.engines_paused = False
        self.events.engines_resumed("weight_update", version, outcome)

    async def _release(self, version: int) -> None:
        """After a failure once weights may have moved: take the engines out of the router,
        let them continue, and mark them as waiting for the next full update."""
        members = self._members
        self.abandoned += 1
        self.fleet.abandon(members)
        for member in members:
            if member.registered:
                member.registered = False
                try:
                    await self.fleet.router.deregister(member.url)
                except Unavailable as exc:
                    log.warning("deregistering %s after an abandoned update: %s", member.url, exc)
        await self._resume_all(members, version, "abandoned")
        log.warning("weight update v%d abandoned: %d engines continue unrouted until the next "
                    "update", version, len(members))

    async def _load_bucket(self, version: int, members: list[EngineMember], group_name: str,
                           bucket: pb.WeightBucket) -> None:
        names = [t.name for t in bucket.tensors]
        dtypes = [t.dtype for t in bucket.tensors]
        shapes = [list(t.shape) for t in bucket.tensors]
        await self._all(version, members,
                        f"update_weights_from_distributed (bucket {bucket.bucket_index})",
                        lambda m: self.fleet.client.update_weights(
                            m.url, names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name))

    async def _form_group(self, begin: pb.WeightUpdateBegin, members: list[EngineMember],
                          world_size: int) -> None:
        client = self.fleet.client
        joined = [m for m in members if m.in_group]
        for member in self.fleet.members:
            member.in_group = False
        if joined:  # leave the old group first; a dead group may refuse, which is fine
            await asyncio.gather(*(client.destroy_group(m.url, begin.group_name)
                                   for m in joined), return_exceptions=True)
        offsets, next_rank = {}, 1
        for member in members:
            offsets[member.url], next_rank = next_rank, next_rank + member.ranks
        await self._all(begin.weight_version, members, "init_weights_update_group",
                        lambda m: client.init_group(
                            m.url, master_address=begin.master_address,
                            master_port=begin.master_port, rank_offset=offsets[m.url],
                            world_size=world_size, group_name=begin.group_name,
                            backend=begin.backend))
        for member in members:
            member.in_group = True

    async def _commit(self, version: int, members: list[EngineMember]) -> None:
        client = self.fleet.client
        await self._all(version, members, "update_weight_version",
                        lambda m: client.set_weight_version(m.url, version))
        try:
            await self.fleet.router.set_weight_version(version)
        except Unavailable as exc:
            raise WeightUpdateFailed(f"weight update v{version}: {exc}; engines hold "
                                     f"v{version} and wait for the next update") from None
        await self.fleet.on_committed(version, members)
        self._on_committed(version)
        await self._all(version, members, "continue_generation", lambda m: client.resume(m.url))
        self.engines_paused = False
        self.events.engines_resumed("weight_update", version, "committed")

    @staticmethod
    async def _all(version: int, members: list[EngineMember], step: str,
                   call: Callable[[EngineMember], Awaitable[object]]) -> None:
        """Run `call` on every engine at once; one precise error naming each failure."""
        results = await asyncio.gather(*(call(m) for m in members), return_exceptions=True)
        failures = [(m, r) for m, r in zip(members, results, strict=True)
                    if isinstance(r, BaseException)]
        if failures:
            detail = "; ".join(f"{m.url}: {r}" for m, r in failures)
            raise WeightUpdateFailed(
                f"weight update v{version}: {step} failed on {len(failures)} of {len(members)} "
                f"engines ({detail})")
