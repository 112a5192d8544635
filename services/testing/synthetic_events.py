"""A synthetic run's events and episodes, in the schema of the events streams.

For the dashboard's tests: `SyntheticRun()` is a healthy run (every advisory silent); each
knob moves one aspect of it past an advisory's threshold. The entries are what the services
write to `riptide:<run>:events` / `riptide:<run>:episodes`, and `write_jsonl` saves them as
an export (the JSONL file `services.common.events.export_events` writes).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.no_verdict import CAUSE_NAMES

T0 = 1_750_000_000.0


@dataclass
class SyntheticRun:
    """Knobs of a synthetic run; the defaults are a healthy one."""

    seed: int = 0
    num_steps: int = 8
    num_engines: int = 2
    dp_size: int = 2
    cap: int = 32
    groups_per_step: int = 4
    samples_per_group: int = 4
    step_s: float = 20.0
    in_flight_fraction: float = 0.9
    busy_engine_share: float = 0.5  # share of the load engine 0 gets (0.5: balanced)
    cache_hit_rate: float = 0.75
    trainer_idle_fraction: float = 0.1
    stall_s: float = 0.0  # > 0: the trainer ends no phase after its last sync for this long
    no_verdict_fraction: float = 0.0
    zero_variance_fraction: float = 0.2
    truncated_fraction: float = 0.05
    abort_fraction: float = 0.0
    stale_drop_fraction: float = 0.0
    stale_length_factor: float = 1.0  # response length of stale-dropped episodes vs others
    live_snapshots: bool = False  # the sandbox services publish `sandbox.live` at the end
    no_load_signal_engines: int = 0  # the last engines: the router reads no load from them
    entries: list[tuple[str, dict[str, Any]]] = field(default_factory=list, repr=False)

    def generate(self) -> list[tuple[str, dict[str, Any]]]:
        """(stream, data) pairs in time order of writing."""
        self.entries, self._rng = [], random.Random(self.seed)
        self._undeleted: list[dict[str, Any]] = []
        self._cumulative = {(e, r): [0, 0] for e in range(self.num_engines)
                            for r in range(self.dp_size)}
        t = T0
        for step in range(1, self.num_steps + 1):
            t = self._step(step, t)
        if self.stall_s:  # rollout goes on reporting its load; the trainer says nothing
            self._load(t, t + self.stall_s, self.num_steps)
        if self.live_snapshots:
            self._live_snapshots(t)
        return self.entries

    def _live_snapshots(self, t: float) -> None:
        """A service that stopped reporting long ago (its rows are stale), then the live one
        listing the sandboxes never deleted."""
        self._event("sandbox.live", "sandbox", t - 600, t - 600, "gone:1", None,
                    instance="gone:1", heartbeat_s=10.0, incarnation="a1",
                    service_instance="host:8053", num_alive=1, num_leased=1, num_reaped=0,
                    num_delete_failures=0, sandboxes=[
                        {"sandbox": "sbx-gone", "task_id": "csv-revenue", "provider": "local",
                         "sample_id": "old", "group_id": "g0", "turns": 1, "state": "running",
                         "age_s": 5.0}])
        rows = [{**row, "provider": "local", "turns": 2, "state": "running",
                 "age_s": t - row["age_s"]} for row in self._undeleted]
        self._event("sandbox.live", "sandbox", t, t, "sandbox:1", None, instance="sandbox:1",
                    heartbeat_s=10.0, incarnation="b2", service_instance="host:8053",
                    num_alive=len(rows), num_leased=len(rows), num_reaped=1,
                    num_delete_failures=0, sandboxes=rows)

    def _event(self, kind: str, service: str, start: float, end: float | None, ident: str,
               version: int | None, **attrs: Any) -> None:
        self.entries.append(("events", {"kind": kind, "service": service, "start": start,
                                        "end": end, "id": ident, "weight_version": version,
                                        "attrs": attrs}))

    def _step(self, step: int, t: float) -> float:
        version = step - 1
        idle = self.trainer_idle_fraction
        wait_s = self.step_s * idle / (1 - idle) if idle < 1 else self.step_s
        self._event("trainer.wait_data", "trainer", t, t + wait_s, f"wait-{step}", version)
        rollout_end = t + wait_s + self.step_s
        self._load(t, rollout_end, version)
        staleness, stale_dropped = self._episodes(step, t, rollout_end, version)
        start = t + wait_s
        end = start + self.step_s * 0.85
        samples = self.groups_per_step * self.samples_per_group
        tokens = samples * 300
        self._event("trainer.step", "trainer", start, end, f"step-{step}", version,
                    step=step, reward_mean=0.4 + 0.02 * step, success_rate=0.3 + 0.03 * step,
                    groups=self.groups_per_step, samples=samples, tokens=tokens,
                    tokens_per_s=tokens / (end - start), loss=0.5 / step, mismatch_kl=1e-4,
                    staleness=staleness, idle_fraction=idle)
        ckpt_end = end + self.step_s * 0.05
        self._event("trainer.checkpoint", "trainer", end, ckpt_end, f"ckpt-{step}", step)
        sync_end = ckpt_end + self.step_s * 0.1
        self._event("trainer.weight_sync", "trainer", ckpt_end, sync_end, f"sync-{step}", step,
                    bytes=1 << 20, buckets=2)
        for bucket in range(2):
            half = (sync_end - ckpt_end) / 2
            self._event("trainer.weight_sync.bucket", "trainer", ckpt_end + bucket * half,
                        ckpt_end + (bucket + 1) * half, f"sync-{step}-{bucket}", step,
                        bucket=bucket)
        for engine in range(self.num_engines):
            self._event("rollout.engine_pause", "rollout", ckpt_end, sync_end,
                        f"pause-{step}-{engine}", step, engine=_engine(engine),
                        reason="weight_update")
        if step % 4 == 0:
            self._event("rollout.eval", "rollout", sync_end, sync_end + 1, f"eval-{step}", step,
                        weight_version=step, mean_success=0.2 + 0.05 * step,
                        per_task={"csv-revenue": 0.5, "config-edit": 0.25})
        return sync_end

    def _load(self, start: float, end: float, version: int) -> None:
        rng, t = self._rng, start
        while t < end:
            in_flight = round(self.cap * self.in_flight_fraction * rng.uniform(0.95, 1.0))
            engines = []
            for (e, r), totals in self._cumulative.items():
                share = self.busy_engine_share if e == 0 else (
                    (1 - self.busy_engine_share) / max(1, self.num_engines - 1))
                running = round(in_flight * share / self.dp_size)
                prompt = 2000 + rng.randrange(200)
                totals[0] += prompt
                totals[1] += round(prompt * self.cache_hit_rate)
                engines.append({"engine": _engine(e), "dp_rank": r, "running": running,
                                "waiting": 0, "cached_tokens": totals[1],
                                "prompt_tokens": totals[0], "healthy": True,
                                "weight_version": version, "circuit": "closed",
                                "load_signal": "missing" if e >= self.num_engines -
                                self.no_load_signal_engines else "ok"})
            self._event("rollout.load", "rollout", t, t, f"load-{t:.0f}", version,
                        in_flight=in_flight, cap=self.cap, engines=engines)
            t += 1.0

    def _episodes(self, step: int, start: float, end: float,
                  version: int) -> tuple[list[int], int]:
        rng, dropped = self._rng, 0
        staleness: list[int] = []
        for g in range(self.groups_per_step):
            group_id = f"g{step}-{g}"
            zero_var = rng.random() < self.zero_variance_fraction
            stale = rng.random() < self.stale_drop_fraction
            for s in range(self.samples_per_group):
                self._episode(step, group_id, s, start, end, version, zero_var, stale)
            if stale:
                dropped += 1
                self._event("trainer.group_dropped", "trainer", end, end, group_id, version,
                            group_id=group_id, reason="stale")
            else:
                staleness.extend(rng.choice((0, 0, 1)) for _ in range(self.samples_per_group))
        return staleness, dropped

    def _episode(self, step: int, group_id: str, index: int, start: float, end: float,
                 version: int, zero_var: bool, stale: bool) -> None:
        rng = self._rng
        sample_id = f"{group_id}-{index}"
        engine, dp_rank = rng.randrange(self.num_engines), rng.randrange(self.dp_size)
        t0 = rng.uniform(start, end - 5)
        t1 = min(end, t0 + rng.uniform(3, 10))
        length = round(rng.uniform(100, 400) * (self.stale_length_factor if stale else 1.0))
        reward = 1.0 if zero_var else float(index % 2)
        verdict = "no_verdict" if rng.random() < self.no_verdict_fraction else "scored"
        truncated = rng.random() < self.truncated_fraction
        aborted = rng.random() < self.abort_fraction
        task = ("csv-revenue", "config-edit", "json-group-by")[step % 3]
        sandbox_id = f"sbx-{sample_id}"
        self._event("sandbox.create", "sandbox", t0, t0 + 0.2, sample_id, None,
                    task_id=task, sandbox=sandbox_id)
        self._event("sandbox.verify", "sandbox", t1 - 0.5, t1, sample_id, None,
                    task_id=task, passed=reward >= 1, exit_code=0 if reward >= 1 else 1)
        if step < self.num_steps or index % 2:  # some sandboxes of the last step stay live
            self._event("sandbox.delete", "sandbox", t1, t1 + 0.1, sandbox_id, None,
                        task_id=task, sandbox=sandbox_id, ok=True)
        else:  # age_s holds the creation time until the snapshot is written
            self._undeleted.append({"sandbox": sandbox_id, "task_id": task,
                                    "sample_id": sample_id, "group_id": group_id,
                                    "age_s": t0 + 0.2})
        self._event("rollout.episode", "rollout", t0, t1, sample_id, version,
                    sample_id=sample_id, group_id=group_id, task_id=task,
                    engine=_engine(engine), dp_rank=dp_rank, turns=2, prompt_tokens=120,
                    response_tokens=length, reward=reward, verdict=verdict,
                    weight_versions=[version], truncated=truncated, aborted=aborted, eval=False,
                    no_verdict_cause=None if verdict == "scored"
                    else CAUSE_NAMES[1 + (step + index) % (len(CAUSE_NAMES) - 1)])
        text = [chr(97 + (i % 26)) for i in range(12)]
        self.entries.append(("episodes", {
            "sample_id": sample_id, "group_id": group_id, "task_id": task, "reward": reward,
            "verdict": verdict,
            "turns": [{"assistant": "Let me look.\n```bash\nls /app\n```",
                       "observation": "data.csv\nnotes.txt"},
                      {"assistant": "```bash\ncat /app/data.csv | wc -l\n```",
                       "observation": "42"}],
            "tokens": {"ids": [ord(c) for c in text],
                       "loss_mask": [0] * 4 + [1] * 8,
                       "logprobs": [0.0] * 4 + [round(-rng.random() * 3, 3) for _ in range(8)]},
            "token_text": text}))


def _engine(index: int) -> str:
    return f"http://127.0.0.1:{30000 + index}"


def write_jsonl(entries: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    """Save entries as an events export: `{"entry_id", "event"}` lines, then
    `{"entry_id", "episode"}` lines (the layout of `export_events`)."""
    with path.open("w", encoding="utf-8") as out:
        for stream, name in (("events", "event"), ("episodes", "episode")):
            for number, (kind, data) in enumerate(entries):
                if kind == stream:
                    out.write(json.dumps({"entry_id": f"{number}-0", name: data}) + "\n")
    return path
