"""Routing policies on a synthetic multi-turn agentic workload, through the real router.

Starts N simulated engines (each with a finite LRU prefix cache that reports cached_tokens
truthfully) and one router process (`riptide serve router`), then for each policy (switched
live with PATCH /admin/config, engine caches flushed in between) keeps `--sessions` agent
sessions running for `--duration-s`: every session shares a system prompt, has its own task
prompt, and each turn's prompt is the previous prompt + the model's output + a tool
observation. Session lengths vary and the mix is skewed: a quarter of the sessions are heavy
(long outputs, many turns). A finished session is replaced at once (closed loop).

Per policy: hit_rate = cached / prompt tokens of every call; imbalance = time-averaged
max/mean of per-target in-flight calls over the steady window; overhead = client-observed
latency minus the engine's own e2e latency (p50, p99, ms); spills from the router's state.
The last line printed is the JSON summary.

    python bench/router.py [--engines 4] [--sessions 64] [--duration-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from services.testing.router_process import RouterProcess  # noqa: E402
from services.testing.sim_engine_process import start_sim_engines  # noqa: E402

POLICIES = ("sticky_min_load", "consistent_hash", "min_load", "round_robin")
VOCAB = 32000


@dataclass
class Call:
    start: float
    end: float
    target: str
    prompt: int
    cached: int
    overhead_s: float


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    errors: int = 0


def _session_shape(rng: random.Random) -> tuple[int, int, int]:
    """(turns, min output tokens, max output tokens): a skewed mix of light and heavy."""
    if rng.random() < 0.25:
        return rng.randint(12, 24), 160, 400
    return rng.randint(3, 10), 32, 128


async def _session(stub: router_pb2_grpc.RouterStub, key: str, system: list[int],
                   rng: random.Random, args: argparse.Namespace, run: Run,
                   stop_at: float) -> None:
    turns, out_lo, out_hi = _session_shape(rng)
    prompt = system + [rng.randrange(VOCAB) for _ in range(args.task_tokens)]
    for _ in range(turns):
        if time.monotonic() >= stop_at:
            return
        params = common_pb2.SamplingParams(max_new_tokens=rng.randint(out_lo, out_hi),
                                           temperature=1.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(session_key=key, input_ids=prompt,
                                             sampling_params=params)
        started = time.monotonic()
        try:
            reply = await stub.Generate(request, timeout=60)
        except Exception:  # noqa: BLE001 - a bench counts failures, it does not stop on them
            run.errors += 1
            return
        ended = time.monotonic()
        run.calls.append(Call(started, ended, f"{reply.engine_url}@{reply.dp_rank}",
                              reply.prompt_tokens, reply.cached_tokens,
                              (ended - started) - reply.engine_latency_s))
        observation = [rng.randrange(VOCAB) for _ in range(rng.randint(*args.obs_tokens))]
        prompt = prompt + list(reply.output_ids) + observation
        await asyncio.sleep(rng.uniform(*args.think_s))


async def _slot(stub: router_pb2_grpc.RouterStub, slot: int, system: list[int],
                args: argparse.Namespace, run: Run, stop_at: float, policy: str) -> None:
    rng = random.Random(args.seed * 1000 + slot)
    await asyncio.sleep(rng.uniform(0, args.ramp_s))
    index = 0
    while time.monotonic() < stop_at:
        await _session(stub, f"{policy}-{slot}-{index}", system, rng, args, run, stop_at)
        index += 1


def imbalance(calls: list[Call], targets: list[str], t0: float, t1: float) -> float:
    """Time-averaged max/mean in-flight calls per target over [t0, t1] (where any ran)."""
    events = sorted([(c.start, 1, c.target) for c in calls]
                    + [(c.end, -1, c.target) for c in calls])
    load = dict.fromkeys(targets, 0)
    weighted = total_time = 0.0
    previous = t0
    for when, delta, target in events:
        now = min(max(when, t0), t1)
        total = sum(load.values())
        if now > previous and total:
            weighted += (max(load.values()) / (total / len(targets))) * (now - previous)
            total_time += now - previous
        previous = max(previous, now)
        load[target] = load.get(target, 0) + delta
    return weighted / total_time if total_time else 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _run_policy(router: RouterProcess, policy: str, engines: list[str],
                      args: argparse.Namespace) -> dict[str, float]:
    router.patch_config(policy=policy)
    async with httpx.AsyncClient() as http:
        for url in engines:
            (await http.post(f"{url}/flush_cache")).raise_for_status()
    spills_before = router.state()["spills"]
    system = [random.Random(args.seed).randrange(VOCAB) for _ in range(args.system_tokens)]
    run = Run()
    async with router.aio_channel() as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        began = time.monotonic()
        stop_at = began + args.duration_s
        await asyncio.gather(*(_slot(stub, i, system, args, run, stop_at, policy)
                               for i in range(args.sessions)))
    prompt = sum(c.prompt for c in run.calls)
    cached = sum(c.cached for c in run.calls)
    overheads = [c.overhead_s * 1000 for c in run.calls]
    targets = [f"{url}@0" for url in engines]
    result = {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "imbalance": round(imbalance(run.calls, targets, began + args.ramp_s + 1, stop_at), 3),
        "overhead_ms_p50": round(_percentile(overheads, 0.5), 3),
        "overhead_ms_p99": round(_percentile(overheads, 0.99), 3),
        "spills": router.state()["spills"] - spills_before,
    }
    print(f"{policy}: {result} calls={len(run.calls)} errors={run.errors}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--sessions", type=int, default=64, help="concurrent agent sessions")
    p.add_argument("--duration-s", type=float, default=20.0, help="per policy")
    p.add_argument("--ramp-s", type=float, default=2.0, help="sessions start spread over this")
    p.add_argument("--system-tokens", type=int, default=2048, help="shared system prompt")
    p.add_argument("--task-tokens", type=int, default=512, help="per-session task prompt")
    p.add_argument("--obs-tokens", type=int, nargs=2, default=(16, 64))
    p.add_argument("--think-s", type=float, nargs=2, default=(0.04, 0.16),
                   help="tool time between turns")
    p.add_argument("--cache-tokens", type=int, default=80_000, help="prefix cache per engine")
    p.add_argument("--session-idle-s", type=float, default=1.0,
                   help="router knob: above the longest tool time of this workload")
    p.add_argument("--decode-s-per-token", type=float, default=0.003)
    p.add_argument("--prefill-s-per-token", type=float, default=0.00002)
    p.add_argument("--max-load-skew", type=float, default=None,
                   help="router knob (default: the router's own default)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    engines = start_sim_engines(args.engines, cache_tokens=args.cache_tokens,
                                decode_s_per_token=args.decode_s_per_token,
                                prefill_s_per_token=args.prefill_s_per_token)
    try:
        urls = [e.url for e in engines]
        knobs = {"session_idle_s": args.session_idle_s}
        if args.max_load_skew is not None:
            knobs["max_load_skew"] = args.max_load_skew
        with RouterProcess(engine_urls=urls, **knobs) as router:
            results = {policy: asyncio.run(_run_policy(router, policy, urls, args))
                       for policy in args.policies}
    finally:
        for engine in engines:
            engine.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
