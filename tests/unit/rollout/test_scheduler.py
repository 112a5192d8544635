"""The scheduler on virtual time against a scripted episode runner and an in-memory sink."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import DeadlineExceeded, Unavailable
from services.rollout.config import SchedulerConfig
from services.rollout.scheduler import Scheduler
from services.rollout.task_cycle import TaskCycle
from services.rollout.task_sampler import task_sampler
from services.testing.memory_sink import MemorySink
from services.testing.virtual_clock import run_virtual


class ScriptedRunner:
    """Episodes that take `duration(request)` seconds and score `reward(request)`."""

    def __init__(
        self,
        duration: Callable[[sandbox_pb2.RunEpisodeRequest], float] = lambda r: 1.0,
        reward: Callable[[sandbox_pb2.RunEpisodeRequest], float] = lambda r: float(
            r.sample_index % 2
        ),
        fail: Callable[[sandbox_pb2.RunEpisodeRequest], bool] = lambda r: False,
    ) -> None:
        self.duration, self.reward, self.fail = duration, reward, fail
        self.version = 0
        self.started: list[tuple[float, str]] = []

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
        loop = asyncio.get_running_loop()
        self.started.append((loop.time(), request.sample_id))
        first = self.version
        await asyncio.sleep(self.duration(request))
        if self.fail(request):
            raise RuntimeError("sandbox exploded")
        return common_pb2.Trajectory(
            response_ids=[1, 2, 3],
            loss_mask=[1, 0, 1],
            weight_versions=[first, -1, self.version],
            reward=self.reward(request),
            status=common_pb2.VERDICT_STATUS_SCORED,
        )


def make(
    runner: ScriptedRunner, sink: MemorySink | None = None, **overrides: object
) -> tuple[Scheduler, MemorySink]:
    cfg = SchedulerConfig(
        **{
            "max_concurrent_samples": 8,
            "n_samples_per_prompt": 4,
            "num_groups_per_batch": 2,
            "max_staleness": None,
            "drop_zero_variance_groups": False,
            **overrides,
        }
    )
    sink = MemorySink() if sink is None else sink
    return Scheduler(cfg, task_sampler(cfg, ["a", "b", "c"]), runner, sink, id_prefix="t"), sink


def test_in_flight_holds_at_target_and_groups_flow() -> None:
    rng = random.Random(0)
    runner = ScriptedRunner(duration=lambda r: rng.lognormvariate(0, 1))

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=16)
        await sched.start()
        seen = []
        for _ in range(200):
            await asyncio.sleep(0.1)
            seen.append(sched.in_flight)
        await sched.stop()
        assert seen == [16] * 200
        assert len(sink) >= 30
        for group in sink.groups:
            assert sorted(t.sample_index for t in group.samples) == [0, 1, 2, 3]
            assert {t.group_id for t in group.samples} == {group.group_id}
            assert {t.task_id for t in group.samples} == {group.task_id}
        assert len({g.group_id for g in sink.groups}) == len(sink)
        assert sched.stats.mean_in_flight(asyncio.get_running_loop().time()) > 15.9

    run_virtual(main())


def test_sample_granularity_refills_each_freed_slot_at_once() -> None:
    # sample 0 of every group is short, the others long.
    runner = ScriptedRunner(duration=lambda r: 1.0 if r.sample_index == 0 else 10.0)

    async def main() -> None:
        sched, _ = make(runner, max_concurrent_samples=8)
        await sched.start()
        await asyncio.sleep(1.5)
        # two short samples finished at t=1 and were replaced at once
        assert sched.stats.submitted_samples == 10 and sched.in_flight == 8
        assert [t for t, _ in runner.started[8:]] == [1.0, 1.0]
        await sched.stop()

    run_virtual(main())


def test_group_granularity_waits_for_a_whole_group_of_slots() -> None:
    runner = ScriptedRunner(duration=lambda r: 1.0 if r.sample_index == 0 else 10.0)

    async def main() -> None:
        sched, _ = make(runner, max_concurrent_samples=8, granularity="group")
        await sched.start()
        await asyncio.sleep(5)
        assert sched.stats.submitted_samples == 8 and sched.in_flight == 6
        await asyncio.sleep(6)  # at t=10 the rest finish: two whole groups start together
        assert sched.stats.submitted_samples == 16 and sched.in_flight == 8
        await sched.stop()

    run_virtual(main())


def test_no_verdict_and_zero_variance_groups_are_dropped_and_counted() -> None:
    runner = ScriptedRunner(
        fail=lambda r: r.group_id.endswith("1") and r.sample_index == 2,
        reward=lambda r: 1.0 if r.group_id.endswith("2") else float(r.sample_index % 2),
    )

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=4, drop_zero_variance_groups=True)
        await sched.start()
        await asyncio.sleep(3.5)  # three groups of 4, one after another
        await sched.stop()
        assert sched.stats.dropped_groups == {"no_verdict": 1, "zero_variance": 1}
        assert sched.stats.dropped_samples == 8 and sched.stats.runner_errors == 1
        assert [g.group_id for g in sink.groups] == ["t-g000003"]

    run_virtual(main())


def test_staleness_zero_admits_one_batch_per_weight_version() -> None:
    runner = ScriptedRunner()

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=100, max_staleness=0)
        await sched.start()
        await asyncio.sleep(5)
        assert sched.stats.submitted_samples == 8 and len(sink) == 2  # one batch, then wait
        await sink.take(2)
        runner.version = 1
        sched.set_weight_version(1)
        await asyncio.sleep(5)
        assert sched.stats.submitted_samples == 16
        await sched.stop()

    run_virtual(main())


def test_staleness_budget_returns_dropped_samples_and_runs_ahead_by_max_staleness() -> None:
    runner = ScriptedRunner(fail=lambda r: r.group_id.endswith("1"))

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=100, max_staleness=1)
        await sched.start()
        await asyncio.sleep(5)
        # two batches of 8 may run ahead; the dropped first group's 4 are given back
        assert sched.stats.submitted_samples == 20 and len(sink) == 4
        assert sched.state()["staleness_budget"] == 0
        await sched.stop()

    run_virtual(main())


def test_group_that_would_be_consumed_too_stale_is_dropped() -> None:
    # group 1 is very slow: by the time it finishes, the trainer has moved on two versions.
    runner = ScriptedRunner(duration=lambda r: 50.0 if r.group_id.endswith("1") else 1.0)

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=100, max_staleness=1)
        await sched.start()
        for version in (1, 2, 3):
            await asyncio.sleep(5)
            await sink.take(2)
            sched.set_weight_version(version)
            runner.version = version
        await asyncio.sleep(60)
        await sched.stop()
        assert sched.stats.dropped_groups["stale"] == 1
        assert all(k <= 1 for k in sched.stats.staleness)

    run_virtual(main())


def test_pause_stops_admission_and_resume_refills() -> None:
    runner = ScriptedRunner()

    async def main() -> None:
        sched, _ = make(runner)
        await sched.start()
        await asyncio.sleep(0.5)
        sched.pause()
        await asyncio.sleep(2)
        assert sched.in_flight == 0 and sched.stats.submitted_samples == 8
        sched.resume()
        await asyncio.sleep(0.1)
        assert sched.in_flight == 8
        await sched.stop()

    run_virtual(main())


def test_live_change_of_concurrency_and_mixed_versions_are_counted() -> None:
    runner = ScriptedRunner()

    async def main() -> None:
        sched, _ = make(runner)
        await sched.start()
        await asyncio.sleep(0.5)
        runner.version = 1  # every sample in flight now ends on a newer version
        sched.config.max_concurrent_samples = 12
        sched.config_changed()
        await asyncio.sleep(0.1)
        assert sched.in_flight == 12
        sched.config.max_concurrent_samples = 4
        await asyncio.sleep(1.0)
        assert sched.in_flight == 4
        assert sched.stats.mixed_version_samples == 8
        await sched.stop()

    run_virtual(main())


def test_sink_failures_are_retried_and_the_group_written_once() -> None:
    class FlakySink(MemorySink):
        failures = 2

        async def put(self, group: common_pb2.Group) -> bool:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("redis down")
            return await super().put(group)

    async def main() -> None:
        sched, sink = make(ScriptedRunner(), sink=FlakySink(), max_concurrent_samples=4)
        await sched.start()
        await asyncio.sleep(1.5)
        assert sched.queued_groups == 1 and len(sink) == 0
        await asyncio.sleep(2)
        await sched.stop()
        assert sched.stats.sink_errors == 2
        assert [g.group_id for g in sink.groups][:1] == ["t-g000001"]

    run_virtual(main())


def test_missing_verdicts_are_counted_by_cause_where_dropped() -> None:
    class CausingRunner(ScriptedRunner):
        """Group 1: one verifier timeout (the sandbox service's verdict), one call past its
        deadline; group 2: one call that failed (the sandbox service was lost)."""

        async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
            trajectory = await super().run(request)
            group, index = request.group_id[-1], request.sample_index
            if (group, index) == ("1", 0):
                return common_pb2.Trajectory(
                    status=common_pb2.VERDICT_STATUS_NO_VERDICT,
                    no_verdict_cause=common_pb2.NO_VERDICT_CAUSE_VERIFIER_TIMEOUT)
            if (group, index) == ("1", 1):
                raise DeadlineExceeded("RunEpisode ran past 600 s")
            if (group, index) == ("2", 3):
                raise Unavailable("RunEpisode failed: UNAVAILABLE")
            return trajectory

    async def main() -> None:
        sched, sink = make(CausingRunner(), max_concurrent_samples=4)
        await sched.start()
        await asyncio.sleep(3.5)
        await sched.stop()
        expected = {"verifier_timeout": 1, "agent_timeout": 1, "sandbox_lost": 1}
        assert sched.stats.no_verdict_by_cause == expected
        assert sched.stats.dropped_no_verdict_by_cause == expected
        assert sched.stats.dropped_groups["no_verdict"] == 2
        state = sched.stats.as_dict(0.0)
        assert state["no_verdict_by_cause"] == state["dropped_no_verdict_by_cause"] == expected

    run_virtual(main())


def test_a_run_of_failing_episodes_backs_off() -> None:
    runner = ScriptedRunner(duration=lambda r: 0.01, fail=lambda r: True)

    async def main() -> None:
        sched, _ = make(runner, max_concurrent_samples=1)
        await sched.start()
        await asyncio.sleep(10)
        await sched.stop()
        # without back-off this would be ~1000 episodes
        assert 8 <= sched.stats.submitted_samples <= 20
        assert sched.stats.dropped_groups["no_verdict"] >= 2

    run_virtual(main())


def test_stop_writes_the_groups_already_complete() -> None:
    class SlowSink(MemorySink):
        async def put(self, group: common_pb2.Group) -> bool:
            await asyncio.sleep(1.0)
            return await super().put(group)

    async def main() -> None:
        sched, sink = make(ScriptedRunner(), sink=SlowSink(), max_concurrent_samples=8)
        await sched.start()
        await asyncio.sleep(1.1)  # two groups complete at t=1; the first write ends at t=2
        assert sched.queued_groups == 2
        await sched.stop()
        assert len(sink) == 2 and sched.queued_groups == 0

    run_virtual(main())


def test_doomed_group_is_cut_short_and_its_slots_reused() -> None:
    # group 1: sample 0 ends at t=1 on version 0, the others would run until t=100
    runner = ScriptedRunner(duration=lambda r: 100.0 if r.group_id.endswith("1")
                            and r.sample_index else 1.0)

    async def main() -> None:
        sched, sink = make(runner, max_concurrent_samples=4, max_staleness=1)
        await sched.start()
        await asyncio.sleep(1.5)
        assert sched.stats.submitted_samples == 5  # sample 0's slot was refilled at t=1
        for version in (1, 2):
            runner.version = version
            sched.set_weight_version(version)
        await asyncio.sleep(0.1)
        assert sched.stats.dropped_groups["stale"] == 1
        assert sched.stats.cancelled_samples == 3
        assert sched.in_flight == 4  # the cancelled episodes' slots are in use again
        await asyncio.sleep(10)
        assert len(sink) >= 1 and "t-g000001" not in sink.seen
        await sched.stop()

    run_virtual(main())


def test_a_full_buffer_stops_admission_until_the_trainer_reads() -> None:
    async def main() -> None:
        sink = MemorySink(capacity=1)
        sched, _ = make(ScriptedRunner(), sink=sink, max_concurrent_samples=4,
                        max_queued_groups=2)
        await sched.start()
        await asyncio.sleep(10)
        # one group in the buffer, two waiting for it; nothing else starts
        assert len(sink) == 1 and sched.queued_groups == 2 and sched.in_flight == 0
        submitted = sched.stats.submitted_samples
        await sink.take(1)
        await asyncio.sleep(0.5)
        assert sched.in_flight == 4 and sched.stats.submitted_samples == submitted + 4
        await sched.stop(flush_timeout_s=0)

    run_virtual(main())


def test_a_rejected_put_is_a_counted_drop_not_a_written_group() -> None:
    """A sink that already holds the id (a collision) refuses it: counted, budget returned."""

    async def main() -> None:
        sink = MemorySink()
        sink.seen.add("t-g000001")  # another incarnation wrote this id
        sched, _ = make(ScriptedRunner(), sink=sink, max_concurrent_samples=4)
        await sched.start()
        await asyncio.sleep(2.5)
        await sched.stop()
        state = sched.state()
        assert state["sink_rejected"] == 1
        assert state["dropped_groups"]["rejected_duplicate_id"] == 1
        assert state["written_groups"] == len(sink) >= 1
        assert "t-g000001" not in [g.group_id for g in sink.groups]

    run_virtual(main())


def test_a_put_refused_after_a_failed_try_counts_as_written() -> None:
    """The first try landed but its reply was lost: the retry's refusal is that write."""

    class LostReplySink(MemorySink):
        lost = 1

        async def put(self, group: common_pb2.Group) -> bool:
            written = await super().put(group)
            if self.lost:
                self.lost -= 1
                raise ConnectionError("reply lost")
            return written

    async def main() -> None:
        sched, sink = make(ScriptedRunner(), sink=LostReplySink(), max_concurrent_samples=4)
        await sched.start()
        await asyncio.sleep(2.5)
        await sched.stop()
        assert sched.stats.sink_errors == 1 and sched.stats.sink_rejected == 0
        assert sched.stats.written_groups == len(sink)

    run_virtual(main())


def test_groups_already_in_the_stream_count_against_the_staleness_budget() -> None:
    """A restarted scheduler with 8 samples' worth of groups ahead of it in the stream."""

    async def main() -> None:
        cfg = SchedulerConfig(max_concurrent_samples=100, n_samples_per_prompt=4,
                              num_groups_per_batch=2, max_staleness=0)
        sink, runner = MemorySink(), ScriptedRunner()
        sched = Scheduler(cfg, TaskCycle(["a"]), runner, sink, id_prefix="t",
                          backlog_samples=8)
        await sched.start()
        await asyncio.sleep(5)
        assert sched.stats.submitted_samples == 0  # the backlog fills this version's batch
        runner.version = 1
        sched.set_weight_version(1)
        await asyncio.sleep(5)
        assert sched.stats.submitted_samples == 8 and len(sink) == 2
        await sched.stop()

    run_virtual(main())


def test_no_admission_while_no_engine_holds_current_weights() -> None:
    async def main() -> None:
        ready = False
        cfg = SchedulerConfig(max_concurrent_samples=8, n_samples_per_prompt=4,
                              num_groups_per_batch=2, max_staleness=None)
        sched = Scheduler(cfg, TaskCycle(["a"]), ScriptedRunner(), MemorySink(),
                          can_generate=lambda: ready)
        await sched.start()
        await asyncio.sleep(3)
        assert sched.stats.submitted_samples == 0
        ready = True
        sched.config_changed()
        await asyncio.sleep(0.1)
        assert sched.in_flight == 8
        await sched.stop()

    run_virtual(main())


def test_default_group_ids_of_two_schedulers_never_collide() -> None:
    cfg = SchedulerConfig(max_concurrent_samples=8, n_samples_per_prompt=4,
                          num_groups_per_batch=2)
    prefixes = {Scheduler(cfg, TaskCycle(["a"]), ScriptedRunner(), MemorySink())._prefix
                for _ in range(200)}
    assert len(prefixes) == 200 and all(len(p.split("-")[-1]) == 32 for p in prefixes)


def test_zero_variance_tasks_cool_down_so_generation_goes_to_tasks_that_teach() -> None:
    """Task "a" is always solved: with a cooldown of 3 passes it runs in about one pass of
    four, without one in every pass."""

    async def run(cooldown: int) -> tuple[int, int, list[str]]:
        runner = ScriptedRunner(
            reward=lambda r: 1.0 if r.task_id == "a" else float(r.sample_index % 2))
        sched, sink = make(runner, max_concurrent_samples=4, drop_zero_variance_groups=True,
                           zero_variance_cooldown_passes=cooldown)
        await sched.start()
        await asyncio.sleep(12.5)  # twelve groups of 4, one after another
        await sched.stop()
        return sched.stats.dropped_groups["zero_variance"], len(sink.groups), \
            sched.state()["task_sampler"]["cooling_tasks"]

    async def main() -> None:
        dropped, written, cooling = await run(cooldown=3)
        assert dropped <= 2 and written >= 10 and cooling in ([], ["a"])
        dropped, written, cooling = await run(cooldown=0)
        assert dropped >= 4 and written <= 9 and cooling == []

    run_virtual(main())


def test_informative_sampling_spends_generation_on_tasks_whose_groups_vary() -> None:
    """Task "a" is always solved and "b" never; only "c"'s groups teach. Drawn by the chance
    of variance, "c" gets most groups; a uniform cycle gives it a third."""

    async def run(sampling: str) -> tuple[int, int]:
        runner = ScriptedRunner(reward=lambda r: {"a": 1.0, "b": 0.0}.get(
            r.task_id, float(r.sample_index % 2)))
        sched, sink = make(runner, max_concurrent_samples=4, drop_zero_variance_groups=True,
                           task_sampling=sampling, task_sampling_floor=0.05)
        await sched.start()
        await asyncio.sleep(24.5)  # 24 groups of 4, one after another
        await sched.stop()
        return sched.stats.dropped_groups["zero_variance"], len(sink.groups)

    async def main() -> None:
        dropped, written = await run("informative")
        assert written >= 15 and dropped <= 9, (dropped, written)
        dropped, written = await run("cycle")
        assert written <= 10 and dropped >= 14, (dropped, written)

    run_virtual(main())
