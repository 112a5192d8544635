"""Events overhead: episodes/s of the local stack with the events streams on vs off, one run.

Two stacks share one redis-server and are identical but for `[run.events] enabled`: each is
the router, the sandbox service (local sandboxes, the bundled tasks, real commands and
verifiers) and the rollout service with one built-in tiny-model engine, so every episode
goes through the path events instrument (scheduler, agent turns through the router, sandbox
create/verify/delete, the per-sample detail). No trainer: its events are a few per step, off
the episode path, and its CPU use would only add noise; the staleness bound is lifted so the
rollout never waits for one. Only one stack generates at a time: the other's rollout is
paused through its admin API and drained first. Windows alternate on/off in ABBA order, so a
drift in the machine's load falls on both sides alike; a window counts the samples the
active rollout finished (its /admin/state) after a short settle.

Usage: python bench/events_overhead.py [--rounds 4] [--window-s 20] [--settle-s 3] [--dir D]
Last line: {"episodes_per_s_on": ..., "episodes_per_s_off": ..., "ratio": on / off,
            "ratio_median_of_rounds": ..., "per_window_on": [...], ...}
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.common import process
from services.common.config import RedisConfig, dump_config
from services.common.events import episodes_key, events_key
from services.common.redis_connect import connect
from services.local_stack import ensure_tiny_model, local_config
from services.testing.redis_server import RedisServer

SERVICES = ("router", "sandbox", "rollout")


class Stack:
    """Router, sandbox and rollout of one run, as `riptide serve` children."""

    def __init__(self, base: Path, name: str, redis: RedisConfig, events: bool) -> None:
        self.name, self.events = name, events
        run_dir = base / name
        model = str(ensure_tiny_model(base))
        self.config = local_config(run_dir, {
            "run": {"name": name, "events": {"enabled": events}},
            "redis": {**redis.model_dump(exclude_none=True), "max_groups": 1_000_000},
            "rollout": {"scheduler": {"max_staleness": 1_000_000},
                        "fleet": {"model_path": model}},
            "sandbox": {"tokenizer_path": model},
        })
        path = run_dir / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_config(self.config))
        self.procs = [process.spawn([sys.executable, "-m", "services.cli", "serve", service,
                                     "--config", str(path)],
                                    log_path=run_dir / "logs" / f"{service}.log")
                      for service in SERVICES]
        self._headers = {"Authorization": f"Bearer {self.config.run.admin_token}"}

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for service in SERVICES:
            url = f"{getattr(self.config, service).admin_url}/readyz"
            while not _ok(url):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"{self.name}: {service} not ready")
                time.sleep(0.5)

    def _rollout(self, method: str, path: str) -> dict[str, Any]:
        resp = httpx.request(method, f"{self.config.rollout.admin_url}{path}",
                             headers=self._headers, timeout=10.0)
        resp.raise_for_status()
        return dict(resp.json())

    def scheduler(self) -> dict[str, Any]:
        return dict(self._rollout("GET", "/admin/state")["details"]["scheduler"] or {})

    def pause(self) -> None:
        self._rollout("POST", "/admin/pause")

    def resume(self) -> None:
        self._rollout("POST", "/admin/resume")

    def drain(self, timeout_s: float = 120.0) -> None:
        """Pause and wait until no episode of this stack is in flight."""
        self.pause()
        deadline = time.monotonic() + timeout_s
        while self.scheduler()["in_flight_samples"] and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            process.stop(proc)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def window(stack: Stack, window_s: float, settle_s: float) -> float:
    """Episodes per second of `stack` alone, over one window."""
    stack.resume()
    time.sleep(settle_s)
    before, started = stack.scheduler()["finished_samples"], time.monotonic()
    time.sleep(window_s)
    after, elapsed = stack.scheduler()["finished_samples"], time.monotonic() - started
    stack.drain()
    return float(after - before) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="on/off window pairs")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="riptide-events-bench-"))
    stacks: list[Stack] = []
    with RedisServer() as server:
        try:
            stacks = [Stack(base, "events-on", server.config, True),
                      Stack(base, "events-off", server.config, False)]
            for stack in stacks:
                stack.wait_ready(300.0)
                stack.drain()
            on, off = stacks
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for index in range(args.rounds):  # ABBA: on off, off on, on off, ...
                order = (on, off) if index % 2 == 0 else (off, on)
                for stack in order:
                    rates["on" if stack.events else "off"].append(
                        window(stack, args.window_s, args.settle_s))
            client = connect(server.config)
            written = {"events": client.xlen(events_key(on.name)),
                       "episodes": client.xlen(episodes_key(on.name)),
                       "events_when_off": client.xlen(events_key(off.name))}
        finally:
            for stack in stacks:
                stack.stop()
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    # Adjacent windows share the machine's load best: the median of per-round ratios is the
    # figure least moved by other tenants; the ratio of means is reported beside it.
    pairs = sorted(a / b for a, b in zip(rates["on"], rates["off"], strict=True) if b)
    mean_on = sum(rates["on"]) / len(rates["on"])
    mean_off = sum(rates["off"]) / len(rates["off"])
    print(json.dumps({
        "bench": "events_overhead", "episodes_per_s_on": round(mean_on, 4),
        "episodes_per_s_off": round(mean_off, 4),
        "ratio": round(mean_on / mean_off, 4) if mean_off else None,
        "ratio_median_of_rounds": round(pairs[len(pairs) // 2], 4) if pairs else None,
        "rounds": args.rounds, "window_s": args.window_s,
        "per_window_on": [round(r, 4) for r in rates["on"]],
        "per_window_off": [round(r, 4) for r in rates["off"]],
        "stream_lengths": written,
    }))


if __name__ == "__main__":
    main()
