"""The weight-update coordinator's protocol against in-process fake engines and router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services._proto.riptide.v1 import rollout_pb2 as pb
from services.common.engine_client import EngineCallError
from services.common.engine_contract import EngineLoad
from services.common.errors import Conflict, InvalidRequest
from services.rollout.config import FleetConfig, WeightUpdateConfig
from services.rollout.fleet import EngineFleet
from services.rollout.router_link import RouterView
from services.rollout.weight_update import WeightUpdateCoordinator, WeightUpdateFailed

URLS = ["http://e0:1", "http://e1:1", "http://e2:1"]
TP = {"http://e0:1": 2, "http://e1:1": 1, "http://e2:1": 4}


class FakeEngines:
    """Records every control call; `fail[(url, step)]` makes that call fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.fail: set[tuple[str, str]] = set()
        self.down: set[str] = set()
        self._barrier: asyncio.Barrier | None = None
        self.parties = len(URLS)

    async def _rec(self, url: str, step: str, body: Any = None) -> None:
        self.calls.append((url, step, body))
        if (url, step) in self.fail:
            raise EngineCallError(url, step, "HTTP 400: boom")

    def steps(self, step: str) -> list[tuple[str, Any]]:
        return [(u, b) for u, s, b in self.calls if s == step]

    async def healthy(self, url: str) -> bool:
        return True

    async def server_info(self, url: str) -> dict[str, Any]:
        return {"tp_size": TP[url]}

    async def load(self, url: str) -> list[EngineLoad]:
        if url in self.down:
            raise EngineCallError(url, "v1/loads", "ConnectError")
        return [EngineLoad(dp_rank=0, num_reqs=0, num_waiting_reqs=0, num_tokens=0)]

    async def weight_version(self, url: str) -> str:
        return "0"

    async def pause(self, url: str, mode: str) -> None:
        await self._rec(url, "pause", mode)

    async def resume(self, url: str) -> None:
        await self._rec(url, "continue")

    async def init_group(self, url: str, **kw: Any) -> None:
        await self._rec(url, "init", kw)

    async def destroy_group(self, url: str, group_name: str) -> None:
        await self._rec(url, "destroy", group_name)

    async def update_weights(self, url: str, **kw: Any) -> None:
        # every engine must be inside this call at once: the buckets go out concurrently
        self._barrier = self._barrier or asyncio.Barrier(self.parties)
        await asyncio.wait_for(self._barrier.wait(), 1.0)
        await self._rec(url, "update", kw)

    async def set_weight_version(self, url: str, version: int) -> None:
        await self._rec(url, "version", version)

    async def update_weights_from_tensor(self, url: str, payload: str) -> None:
        await self._rec(url, "tensor", payload)

    async def memory_occupation(self, url: str, action: str, tags: list[str] | None) -> int:
        await self._rec(url, action, tags)
        return 100


class FakeRouter:
    def __init__(self) -> None:
        self.registered: list[str] = []
        self.versions: list[int] = []
        self.version: int | None = None

    async def view(self) -> RouterView:
        return RouterView(frozenset(self.registered), self.version)

    async def register(self, url: str) -> None:
        self.registered.append(url)

    async def deregister(self, url: str) -> None:
        self.registered.remove(url)

    async def set_weight_version(self, version: int) -> None:
        self.versions.append(version)
        self.version = version


async def _setup() -> tuple[WeightUpdateCoordinator, FakeEngines, FakeRouter, list[int]]:
    engines, router = FakeEngines(), FakeRouter()
    committed: list[int] = []
    fleet = EngineFleet(FleetConfig(kind="attach", attach_urls=URLS, health_interval_s=60),
                        engines, router, weight_version=0)  # type: ignore[arg-type]
    await fleet.start()
    coordinator = WeightUpdateCoordinator(fleet, WeightUpdateConfig(), committed.append)
    return coordinator, engines, router, committed


class _TrainerStream:
    """The trainer's requests of one update: Begin, Joining when the group answer says it
    must join (`_events` reads the answers to it, as a trainer does), Buckets, Commit."""

    def __init__(self, version: int, num_buckets: int, commit: bool = True) -> None:
        self.must_join: bool | None = None
        self._requests = self._generate(version, num_buckets, commit)

    def __aiter__(self) -> _TrainerStream:
        return self

    async def __anext__(self) -> pb.WeightUpdateRequest:
        return await anext(self._requests)

    async def _generate(self, version: int, num_buckets: int, commit: bool
                        ) -> AsyncIterator[pb.WeightUpdateRequest]:
        yield pb.WeightUpdateRequest(begin=pb.WeightUpdateBegin(
            weight_version=version, master_address="127.0.0.1", master_port=29500,
            group_name="wu", backend="gloo"))
        if self.must_join:
            yield pb.WeightUpdateRequest(joining=pb.WeightUpdateJoining())
        for i in range(num_buckets):
            yield pb.WeightUpdateRequest(bucket=pb.WeightBucket(bucket_index=i, tensors=[
                pb.TensorSpec(name=f"w{i}", dtype="bfloat16", shape=[2, 3])]))
        if commit:
            yield pb.WeightUpdateRequest(commit=pb.WeightUpdateCommit())

    def read(self, event: pb.WeightUpdateEvent) -> None:
        if event.WhichOneof("event") == "group":
            self.must_join = event.group.trainer_must_join


def _stream(version: int, num_buckets: int, commit: bool = True) -> _TrainerStream:
    return _TrainerStream(version, num_buckets, commit)


async def _events(coordinator: WeightUpdateCoordinator, stream: AsyncIterator[Any]
                  ) -> list[tuple[str, Any]]:
    out = []
    async for event in coordinator.run(stream):
        if isinstance(stream, _TrainerStream):
            stream.read(event)
        kind = event.WhichOneof("event")
        value = getattr(event, kind)
        out.append((kind, (value.world_size, value.trainer_must_join) if kind == "group"
                    else value))
    return out


def test_first_update_forms_the_group_then_later_ones_reuse_it() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        events = await _events(coordinator, _stream(1, 2))
        assert events == [("group", (8, True)), ("bucket_loaded", 0), ("bucket_loaded", 1),
                          ("committed", 1)]
        inits = {u: (b["rank_offset"], b["world_size"]) for u, b in engines.steps("init")}
        assert inits == {URLS[0]: (1, 8), URLS[1]: (3, 8), URLS[2]: (4, 8)}
        order = [s for _, s, _ in engines.calls]
        assert order.index("init") > max(i for i, s in enumerate(order) if s == "pause")
        assert len(engines.steps("update")) == 6
        assert engines.steps("version") == [(u, 1) for u in URLS]
        assert order[-3:] == ["continue"] * 3 and router.versions == [1] and committed == [1]
        assert {b for _, s, b in engines.calls if s == "pause"} == {"retract"}

        engines.calls.clear()
        events = await _events(coordinator, _stream(2, 1))
        assert events[0] == ("group", (8, False)) and not engines.steps("init")
        assert committed == [1, 2] and coordinator.fleet.current_version == 2

    asyncio.run(main())


def test_failed_bucket_names_engine_and_step_and_leaves_no_engine_paused() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        await _events(coordinator, _stream(1, 1))
        engines.calls.clear()
        engines.fail.add((URLS[2], "update"))
        with pytest.raises(WeightUpdateFailed) as info:
            await _events(coordinator, _stream(2, 3))
        message = str(info.value)
        assert URLS[2] in message and "bucket 0" in message
        assert not engines.steps("version") and router.versions == [1] and committed == [1]
        # Their weights may be mixed: out of the router, generating nothing routed, not paused.
        assert len(engines.steps("continue")) == 3 and not coordinator.engines_paused
        assert router.registered == [] and coordinator.fleet.needs_weights
        assert coordinator.history[-1]["status"] == "failed" and coordinator.abandoned == 1
        # the next update forms the group again, sends everything and registers them again
        engines.fail.clear()
        engines.calls.clear()
        events = await _events(coordinator, _stream(2, 1))
        assert events[0] == ("group", (8, True)) and len(engines.steps("init")) == 3
        assert len(engines.steps("continue")) == 3 and not coordinator.engines_paused
        assert sorted(router.registered) == sorted(URLS) and not coordinator.fleet.needs_weights

    asyncio.run(main())


def test_trainer_vanishing_mid_update_leaves_no_engine_paused() -> None:
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        await _events(coordinator, _stream(1, 1))
        engines.calls.clear()
        with pytest.raises(WeightUpdateFailed, match="before Commit after 2 buckets"):
            await _events(coordinator, _stream(2, 2, commit=False))
        assert len(engines.steps("continue")) == 3 and not coordinator.engines_paused
        assert router.registered == [] and coordinator.fleet.needs_weights

    asyncio.run(main())


def test_a_restarted_router_gets_the_engines_and_the_version_back() -> None:
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        await _events(coordinator, _stream(1, 1))
        assert sorted(router.registered) == sorted(URLS) and router.versions == [1]
        router.registered.clear()        # the router restarted: it holds nothing
        router.version = None
        assert await coordinator.fleet.reconcile_router() == 3
        assert sorted(router.registered) == sorted(URLS) and router.versions == [1, 1]
        assert await coordinator.fleet.reconcile_router() == 0  # nothing missing: no calls
        assert router.versions == [1, 1]

    asyncio.run(main())


def test_an_engine_missing_health_checks_is_not_registered_again() -> None:
    """The router dropped an engine that stopped answering: registering it again would wait
    on it (the router probes it) and keep the health loop from finding it hung."""
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        await _events(coordinator, _stream(1, 1))
        hung = coordinator.fleet.members[1]
        router.registered.remove(hung.url)
        hung.missed_checks = 1
        assert await coordinator.fleet.reconcile_router() == 0
        assert hung.url not in router.registered
        hung.missed_checks = 0  # it answers again: back in the router
        assert await coordinator.fleet.reconcile_router() == 1
        assert hung.url in router.registered

    asyncio.run(main())


def test_an_engine_that_missed_one_check_is_asked_again_before_it_sits_out() -> None:
    """One health answer late on a busy host must not cost an engine its weight update; an
    engine that still does not answer sits out, and the update does not wait on it."""
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        late, hung = coordinator.fleet.members[0], coordinator.fleet.members[2]
        late.missed_checks = hung.missed_checks = 1
        engines.down.add(hung.url)
        engines.parties = 2
        events = await _events(coordinator, _stream(1, 1))
        assert events[0] == ("group", (4, True))  # 1 + 2 (e0) + 1 (e1) ranks, without e2
        assert late.missed_checks == 0 and late.weight_version == 1
        assert hung.missed_checks == 1 and not hung.in_group
        assert sorted(u for u, _ in engines.steps("update")) == [URLS[0], URLS[1]]

    asyncio.run(main())


def test_restarted_engine_triggers_a_new_group_and_is_registered_after_commit() -> None:
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        await _events(coordinator, _stream(1, 1))
        restarted = coordinator.fleet.members[1]
        restarted.in_group, restarted.registered, restarted.state = False, False, "awaiting_weights"
        router.registered.remove(restarted.url)
        engines.calls.clear()
        events = await _events(coordinator, _stream(2, 1))
        assert events[0] == ("group", (8, True))
        assert sorted(u for u, _ in engines.steps("destroy")) == [URLS[0], URLS[2]]
        assert restarted.url in router.registered and restarted.state == "ready"
        assert restarted.weight_version == 2

    asyncio.run(main())


def test_stream_ending_before_any_bucket_resumes_the_engines() -> None:
    async def main() -> None:
        coordinator, engines, _, committed = await _setup()
        with pytest.raises(WeightUpdateFailed, match="before Commit after 0 buckets"):
            await _events(coordinator, _stream(1, 0, commit=False))
        assert len(engines.steps("continue")) == 3 and not coordinator.engines_paused
        assert committed == []

    asyncio.run(main())


def test_unreachable_attached_engine_sits_out_and_rejoins_with_new_weights() -> None:
    async def main() -> None:
        coordinator, engines, router, _ = await _setup()
        fleet = coordinator.fleet
        await _events(coordinator, _stream(1, 1))
        engines.down.add(URLS[2])
        await asyncio.gather(*(fleet._poll(m) for m in fleet.members))
        assert fleet.members[2].state == "unreachable"
        engines.parties, engines._barrier = 2, None
        events = await _events(coordinator, _stream(2, 1))
        assert events[0] == ("group", (4, True))  # 1 + 2 + 1 ranks without e2
        engines.down.clear()
        await asyncio.gather(*(fleet._poll(m) for m in fleet.members))
        assert fleet.members[2].state == "awaiting_weights"  # it came back on version 0
        engines.parties, engines._barrier = 3, None
        events = await _events(coordinator, _stream(3, 1))
        assert events[0] == ("group", (8, True))
        assert fleet.members[2].state == "ready" and fleet.members[2].weight_version == 3

    asyncio.run(main())


def test_trainer_leaving_right_after_commit_keeps_the_group() -> None:
    async def main() -> None:
        coordinator, _, _, _ = await _setup()
        stream = _stream(1, 1)
        events = coordinator.run(stream)
        async for event in events:
            stream.read(event)
            if event.WhichOneof("event") == "committed":
                break
        await events.aclose()  # type: ignore[attr-defined]
        assert coordinator.history[-1]["status"] == "committed"
        assert (await _events(coordinator, _stream(2, 1)))[0] == ("group", (8, False))

    asyncio.run(main())


def _begin(**fields: Any) -> pb.WeightUpdateRequest:
    good: dict[str, Any] = {"weight_version": 2, "master_address": "127.0.0.1",
                            "master_port": 29500, "group_name": "wu", "backend": "gloo"}
    return pb.WeightUpdateRequest(begin=pb.WeightUpdateBegin(**{**good, **fields}))


def _bucket(index: int = 0, **tensor: Any) -> pb.WeightUpdateRequest:
    spec = {"name": "w", "dtype": "bfloat16", "shape": [2, 3], **tensor}
    return pb.WeightUpdateRequest(bucket=pb.WeightBucket(bucket_index=index,
                                                         tensors=[pb.TensorSpec(**spec)]))


async def _requests(*items: pb.WeightUpdateRequest) -> AsyncIterator[pb.WeightUpdateRequest]:
    for item in items:
        yield item


@pytest.mark.parametrize(("begin", "message"), [
    (_begin(weight_version=-3), "begin.weight_version: must be 0 or more, got -3"),
    (_begin(master_port=0), "begin.master_port: must be in [1, 65535], got 0"),
    (_begin(master_address=""), "begin.master_address: a host name or address is needed"),
    (_begin(master_address="h" * 10_000), "(10000 chars)"),
    (_begin(group_name=""), "begin.group_name: 1 to 128 characters"),
    (_begin(backend="mpi"), "begin.backend: one of gloo, nccl, got mpi"),
])
def test_a_bad_begin_is_refused_before_any_engine_is_touched(
        begin: pb.WeightUpdateRequest, message: str) -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        engines.calls.clear()
        with pytest.raises(InvalidRequest) as info:
            await _events(coordinator, _requests(begin, _bucket(), pb.WeightUpdateRequest(
                commit=pb.WeightUpdateCommit())))
        assert message in str(info.value) and len(str(info.value)) < 200
        assert engines.calls == [] and not coordinator.state()["in_progress"]
        assert committed == [] and not coordinator.history
        assert (await _events(coordinator, _stream(1, 1)))[-1] == ("committed", 1)

    asyncio.run(main())


@pytest.mark.parametrize(("bucket", "message"), [
    (_bucket(index=3), "buckets come in order from 0, expected 0, got 3"),
    (_bucket(dtype="complex128"), "bucket 0 tensors[0].dtype: one of bfloat16"),
    (_bucket(shape=[4, -1]), "bucket 0 tensors[0].shape: at most 8 dimensions of 1 or more"),
    (_bucket(shape=[2**21, 2**21]), f"and at most {2**40} elements, got [2097152, 2097152]"),
    (_bucket(shape=[1] * 9), "at most 8 dimensions"),
    (_bucket(name=""), "bucket 0 tensors[0].name: 1 to 512 characters"),
    (pb.WeightUpdateRequest(bucket=pb.WeightBucket(bucket_index=0)),
     "bucket 0: 1 to 100000 tensors, got 0"),
    (pb.WeightUpdateRequest(bucket=pb.WeightBucket(bucket_index=0, tensors=[
        pb.TensorSpec(name="w", dtype="float32", shape=[1])] * 2)),
     "name: w appears twice in the bucket"),
])
def test_a_bad_first_bucket_reaches_no_engine_and_loses_nothing(
        bucket: pb.WeightUpdateRequest, message: str) -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        await _events(coordinator, _stream(1, 1))
        engines.calls.clear()
        with pytest.raises(InvalidRequest) as info:
            await _events(coordinator, _requests(_begin(), bucket))
        assert message in str(info.value), str(info.value)
        assert not engines.steps("update"), "no engine saw the bad bucket"
        # No weight moved: the engines go on generating at v1, still routed.
        assert len(engines.steps("continue")) == 3 and not coordinator.engines_paused
        assert sorted(router.registered) == sorted(URLS) and coordinator.abandoned == 0
        assert not coordinator.fleet.needs_weights and committed == [1]
        assert coordinator.history[-1]["status"] == "failed"
        events = await _events(coordinator, _stream(2, 1))  # the next update goes through
        assert events[0] == ("group", (8, True)) and events[-1] == ("committed", 2)

    asyncio.run(main())


def test_a_bad_bucket_after_loaded_ones_releases_the_engines_for_a_full_update() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        await _events(coordinator, _stream(1, 1))
        with pytest.raises(InvalidRequest, match="buckets come in order from 0, expected 1"):
            await _events(coordinator, _requests(_begin(), _bucket(0), _bucket(0)))
        # Bucket 0 was loaded: weights may be mixed, so out of the router until a full update.
        assert not coordinator.engines_paused and coordinator.abandoned == 1
        assert router.registered == [] and coordinator.fleet.needs_weights

    asyncio.run(main())


def test_engines_rendezvous_only_after_the_trainer_says_joining() -> None:
    # A re-formed group keeps its name and port: an engine sent to rendezvous while the
    # trainer still held the old group completed against the old store and hung there.
    async def main() -> None:
        coordinator, engines, _, committed = await _setup()
        joining = asyncio.Event()

        async def trainer() -> AsyncIterator[pb.WeightUpdateRequest]:
            yield _begin(weight_version=1)
            await joining.wait()
            yield pb.WeightUpdateRequest(joining=pb.WeightUpdateJoining())
            yield _bucket(0)
            yield pb.WeightUpdateRequest(commit=pb.WeightUpdateCommit())

        events = coordinator.run(trainer())
        assert (await anext(events)).group.trainer_must_join
        pending = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        assert not engines.steps("init") and not pending.done()
        joining.set()
        assert (await pending).bucket_loaded == 0 and len(engines.steps("init")) == 3
        assert (await anext(events)).committed == 1 and committed == [1]

    asyncio.run(main())


def test_a_trainer_that_skips_joining_is_refused_and_no_engine_rendezvous() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        with pytest.raises(InvalidRequest, match="expected joining after the group answer"):
            await _events(coordinator, _requests(_begin(weight_version=1), _bucket(0)))
        assert not engines.steps("init") and not coordinator.engines_paused
        assert committed == [] and len(engines.steps("continue")) == 3
        assert (await _events(coordinator, _stream(1, 1)))[-1] == ("committed", 1)

    asyncio.run(main())


def test_colocated_update_moves_payloads_without_a_group() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        begin = _begin(colocated=True, master_port=0, group_name="", backend="")
        buckets = [pb.WeightUpdateRequest(bucket=pb.WeightBucket(
            bucket_index=i, tensors=[pb.TensorSpec(name=f"w{i}", dtype="bfloat16", shape=[2])],
            serialized_named_tensors=f"payload-{i}")) for i in range(2)]
        events = await _events(coordinator, _requests(
            begin, *buckets, pb.WeightUpdateRequest(commit=pb.WeightUpdateCommit())))
        assert events == [("group", (0, False)), ("bucket_loaded", 0), ("bucket_loaded", 1),
                          ("committed", 2)]
        assert not engines.steps("init") and not engines.steps("update")
        order = [s for _, s, _ in engines.calls]
        assert order[:6] == ["pause"] * 3 + ["resume"] * 3  # weights resumed before any load
        assert engines.steps("resume")[0][1] == ["weights"]
        assert sorted(b for _, b in engines.steps("tensor")) == ["payload-0"] * 3 + [
            "payload-1"] * 3
        assert [b for _, b in engines.steps("resume")][3:] == [None] * 3  # kv cache at commit
        assert order.index("version") > max(i for i, s in enumerate(order) if s == "tensor")
        assert committed == [2] and router.versions == [2] and not coordinator.engines_paused

    asyncio.run(main())


@pytest.mark.parametrize(("colocated", "payload", "message"), [
    (True, "", "serialized_named_tensors is needed in a colocated update"),
    (False, "x", "serialized_named_tensors is only for colocated updates"),
])
def test_a_bucket_must_match_the_transport(colocated: bool, payload: str, message: str) -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        bucket = pb.WeightUpdateRequest(bucket=pb.WeightBucket(
            bucket_index=0, tensors=[pb.TensorSpec(name="w", dtype="bfloat16", shape=[2])],
            serialized_named_tensors=payload))
        stream = _requests(_begin(colocated=colocated), bucket)
        if not colocated:  # a broadcast update joins first
            stream = _requests(_begin(), pb.WeightUpdateRequest(
                joining=pb.WeightUpdateJoining()), bucket)
        with pytest.raises(InvalidRequest, match=message):
            await _events(coordinator, stream)
        assert not engines.steps("tensor") and not engines.steps("update")

    asyncio.run(main())


def test_engines_release_their_memory_between_updates_only() -> None:
    async def main() -> None:
        coordinator, engines, router, committed = await _setup()
        reply = await coordinator.release_memory([])
        assert (reply.num_engines, reply.freed_bytes) == (3, 300)
        assert engines.steps("release") == [(u, None) for u in URLS]
        with pytest.raises(InvalidRequest, match=r"unknown memory tag\(s\) \['gpu'\]"):
            await coordinator.release_memory(["gpu"])
        async with coordinator._busy:  # an update in progress
            with pytest.raises(Conflict, match="in progress"):
                await coordinator.release_memory(["kv_cache"])
        assert len(engines.steps("release")) == 3

    asyncio.run(main())
