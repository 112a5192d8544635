"""Rollout/training overlap at reference scale: the real scheduler against simulated parts.

8 simulated engines, 128 samples in flight, groups of 8, batches of 64 samples, long-tailed
episodes (services/testing/sim_episodes.py). A simulated trainer takes a batch of groups from
an in-memory sink with the sample buffer's semantics, steps for `train_ratio` x the measured
generation time of one batch, then updates weights (engines paused for `sync_s`, then the
new version goes to the engines and the scheduler). Everything runs on a virtual-time event
loop, so hours of simulated time take seconds and the figures do not depend on machine load.

Modes: async_sample (fully async, per-sample submission), async_group (fully async, per-group
submission), sync (max_staleness 0: generate one batch, train, update, repeat).
Idle fraction and samples/s count from the moment the trainer has its first batch (before
that every mode waits for the same warm-up); `*_with_warmup` include it.

    python bench/overlap.py [--steps 100] [--train-ratio 1.0] [--max-staleness 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from services.rollout.config import SchedulerConfig
from services.rollout.scheduler import Scheduler
from services.rollout.task_cycle import TaskCycle
from services.testing.memory_sink import MemorySink
from services.testing.sim_episodes import SimEpisodeRunner, VirtualEngine
from services.testing.virtual_clock import run_virtual

NUM_ENGINES = 8
IN_FLIGHT = 128
GROUP = 8
GROUPS_PER_BATCH = 8


async def _run_mode(granularity: str, max_staleness: int | None, steps: int, train_s: float,
                    sync_s: float, seed: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    engines = [VirtualEngine(f"engine-{i}") for i in range(NUM_ENGINES)]
    config = SchedulerConfig(
        max_concurrent_samples=IN_FLIGHT, granularity=granularity,  # type: ignore[arg-type]
        max_staleness=max_staleness, n_samples_per_prompt=GROUP,
        num_groups_per_batch=GROUPS_PER_BATCH, max_queued_groups=10_000,
        drop_zero_variance_groups=False)
    sink = MemorySink()
    scheduler = Scheduler(config, TaskCycle([f"task-{i}" for i in range(89)], seed=seed),
                          SimEpisodeRunner(engines, seed=seed), sink, id_prefix=granularity)
    await scheduler.start()
    start = loop.time()
    idle = 0.0
    first_batch_at = 0.0
    staleness: list[int] = []
    in_flight_samples: list[int] = []
    version = 0
    for step in range(steps):
        t0 = loop.time()
        batch = await sink.take(GROUPS_PER_BATCH)
        if step == 0:
            first_batch_at = loop.time()
        else:
            idle += loop.time() - t0
        staleness += [version - g.min_weight_version for g in batch]
        in_flight_samples.append(scheduler.in_flight)
        if train_s:
            await asyncio.sleep(train_s)
        for engine in engines:
            engine.pause()
        if sync_s:
            await asyncio.sleep(sync_s)
        version += 1
        for engine in engines:
            engine.weight_version = version
            engine.resume()
        scheduler.set_weight_version(version)
    end = loop.time()
    await scheduler.stop()
    consumed = (steps - 1) * GROUPS_PER_BATCH * GROUP
    steady = end - first_batch_at
    stats = scheduler.stats
    return {
        "trainer_idle_fraction": round(idle / steady, 4),
        "samples_per_s": round(consumed / steady, 4),
        "trainer_idle_fraction_with_warmup": round((idle + first_batch_at - start)
                                                   / (end - start), 4),
        "samples_per_s_with_warmup": round(steps * GROUPS_PER_BATCH * GROUP / (end - start), 4),
        "step_s_mean": round(steady / (steps - 1), 2),
        "staleness_max": max(staleness),
        "staleness_mean": round(statistics.mean(staleness), 3),
        "staleness_violations": sum(s > (max_staleness or 0) for s in staleness)
        if max_staleness is not None else None,
        "mixed_version_share": round(stats.mixed_version_share(), 4),
        "stale_dropped_groups": stats.dropped_groups.get("stale", 0),
        "mean_in_flight": round(stats.mean_in_flight(end), 2),
        "in_flight_at_step_start_mean": round(statistics.mean(in_flight_samples), 2),
    }


async def _calibrate(seed: int) -> float:
    """Seconds to generate one batch with 128 in flight and nothing holding generation back."""
    loop = asyncio.get_running_loop()
    engines = [VirtualEngine(f"engine-{i}") for i in range(NUM_ENGINES)]
    config = SchedulerConfig(max_concurrent_samples=IN_FLIGHT, max_staleness=None,
                             n_samples_per_prompt=GROUP, num_groups_per_batch=GROUPS_PER_BATCH,
                             max_queued_groups=10_000, drop_zero_variance_groups=False)
    sink = MemorySink()
    scheduler = Scheduler(config, TaskCycle(["t"]), SimEpisodeRunner(engines, seed=seed + 1),
                          sink, id_prefix="cal")
    await scheduler.start()
    await asyncio.sleep(1500.0)  # warm up past the first wave
    written0, t0 = scheduler.stats.written_samples, loop.time()
    await asyncio.sleep(6000.0)
    rate = (scheduler.stats.written_samples - written0) / (loop.time() - t0)
    await scheduler.stop()
    return GROUPS_PER_BATCH * GROUP / rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="trainer steps per mode")
    parser.add_argument("--train-ratio", type=float, default=1.0,
                        help="trainer step time / generation time of one batch")
    parser.add_argument("--sync-ratio", type=float, default=0.05,
                        help="weight-update time (engines paused) / trainer step time")
    parser.add_argument("--max-staleness", type=int, default=8, help="for the async modes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    batch_gen_s = run_virtual(_calibrate(args.seed))
    train_s = args.train_ratio * batch_gen_s
    sync_s = args.sync_ratio * train_s
    print(f"calibration: one batch of {GROUPS_PER_BATCH * GROUP} samples takes "
          f"{batch_gen_s:.1f} s at {IN_FLIGHT} in flight; trainer step {train_s:.1f} s, "
          f"weight update {sync_s:.1f} s (simulated time)")
    result: dict[str, Any] = {}
    for name, granularity, staleness in (("async_sample", "sample", args.max_staleness),
                                         ("async_group", "group", args.max_staleness),
                                         ("sync", "group", 0)):
        result[name] = run_virtual(_run_mode(granularity, staleness, args.steps, train_s,
                                             sync_s, args.seed))
        print(name, json.dumps(result[name]))
    result["speedup_async_sample_vs_sync"] = round(
        result["async_sample"]["samples_per_s"] / result["sync"]["samples_per_s"], 3)
    result["setup"] = {"engines": NUM_ENGINES, "in_flight": IN_FLIGHT, "group": GROUP,
                       "batch_samples": GROUPS_PER_BATCH * GROUP, "steps": args.steps,
                       "batch_generation_s": round(batch_gen_s, 1), "train_step_s":
                       round(train_s, 1), "weight_update_s": round(sync_s, 1),
                       "max_staleness": args.max_staleness}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
