"""Routing policies on a family of agentic traces, and the router's per-call overhead.

Every trace starts 4 simulated engines (finite LRU prefix caches that report cached_tokens
truthfully, `--max-running` calls at once, the rest queued) and one router process (`riptide
serve router`), then runs each policy for `--duration-s` with `--sessions` agent sessions in
a closed loop: a shared system prompt, a per-session task prompt, each turn's prompt = the
previous prompt + the model's output + a tool observation, tool time between turns, and
`EndSession` when a session ends. The traces:

- `base`: the present trace (80k-token caches, a quarter of the sessions heavy);
- `cache_half`, `cache_two_thirds`: caches holding 1/2 and 2/3 of the live context;
- `double`: 2x sessions (and so 2x concurrency);
- `skewed`: long-tailed session lengths (a tenth very long, the rest short);
- `slow_engine`: one engine decodes at half speed;
- `eject`: one engine fails health checks and answers 503 while the second third of the
  sessions starts, then comes back.

Policies: `perfect` is perfect client-side stickiness, the reference (the client pins each
session to the engine with the fewest live sessions and calls it directly, re-pinning only
when a call fails); `sticky_min_load` is the router's default; `manual` is the Riptide
router's model of sglang-router's manual policy (min_load assignment, then sticky);
`sglang_router` is the real sglang-router (`pip install sglang-router==0.3.2`, manual policy,
min_load assignment) on the same engines, skipped when it is not installed.

Per trace and policy: hit_rate = cached / prompt tokens; imbalance = time-averaged max/mean
in-flight calls per engine over the steady window; switch_rate = share of a session's later
calls that went to another engine than its previous call; overhead = client latency minus
the engine's own e2e latency (p50, p99 ms). Then the overhead bench: fixed small calls at
concurrency 1 and 8, direct to an engine vs through the router's HTTP front and gRPC and
through sglang-router, interleaved over `--overhead-rounds` rounds in the same run, with the
round trip of an RPC that calls no engine (`EndSession`) as grpcio's own floor. Per path: the
overhead over the direct call (p50, p99 ms) and the proxy process's own CPU per call (all its
threads, from /proc); per round, the path's p50 minus sglang-router's, whose mean and 95%
interval judge the target (the router's overhead at most sglang-router's: `at_most` when the
interval reaches 0 or below, `lower` when it lies below 0; for the HTTP front, sglang-router's
like, and for gRPC). `--router-event-loop` picks the router's loop (uvloop, its default, or
asyncio). The last line printed is the JSON summary.

With `--repeats N` each trace runs N times (seeds --seed, --seed + 1, ...): each policy's
figures are the means, and the target is judged over the paired repeats (the mean
imbalance difference with a 95% interval; met when the hit ratio is at least 0.98 and the
interval reaches 0 or below).

    python bench/router.py [--traces base eject] [--policies perfect sticky_min_load]
        [--repeats 4] [--overhead-calls 0]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import httpx  # noqa: E402
import orjson  # noqa: E402

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from services.testing.latency import (  # noqa: E402
    T95,
    paired_difference,
    percentile,
    process_cpu_s,
)
from services.testing.router_process import RouterProcess  # noqa: E402
from services.testing.sglang_router_process import (  # noqa: E402
    SglangRouterProcess,
    sglang_router_installed,
)
from services.testing.sim_engine_process import SimEngineProcess  # noqa: E402

VOCAB = 32000
POLICIES = ("perfect", "sticky_min_load", "manual", "sglang_router", "consistent_hash",
            "min_load", "round_robin")


@dataclass(frozen=True)
class Trace:
    name: str
    sessions_x: int = 1            # x --sessions
    cache_of_live: float = 0.0     # caches hold this share of the live context (0: --cache)
    skewed: bool = False
    slow_engine: bool = False
    eject: bool = False


TRACES = {t.name: t for t in (
    Trace("base"), Trace("cache_half", cache_of_live=0.5),
    Trace("cache_two_thirds", cache_of_live=2 / 3), Trace("double", sessions_x=2),
    Trace("skewed", skewed=True), Trace("slow_engine", slow_engine=True),
    Trace("eject", eject=True))}


def session_shape(rng: random.Random, skewed: bool) -> tuple[int, int, int]:
    """(turns, min output tokens, max output tokens) of one session."""
    if skewed:
        if rng.random() < 0.1:
            return rng.randint(30, 48), 200, 480
        return rng.randint(2, 6), 24, 96
    if rng.random() < 0.25:
        return rng.randint(12, 24), 160, 400
    return rng.randint(3, 10), 32, 128


@dataclass(frozen=True)
class SessionSpec:
    """One session of the workload: the same for every policy of a trace."""

    seed: int
    outputs: tuple[int, ...]       # output tokens per turn

    def busy_s(self, args: argparse.Namespace) -> float:
        return sum(o * args.decode_s_per_token + sum(args.think_s) / 2 for o in self.outputs)


def workload(trace: Trace, args: argparse.Namespace) -> list[SessionSpec]:
    """Sessions in the order slots take them, enough that (by each session's busy time) no
    slot runs dry before --duration-s: the steady window, where every slot is busy, then
    lasts about that long."""
    rng = random.Random(args.seed)
    slots = args.sessions * trace.sessions_x
    free_at = [args.ramp_s * i / slots for i in range(slots)]  # a min-heap already
    specs: list[SessionSpec] = []
    while free_at[0] < args.duration_s:
        turns, lo, hi = session_shape(rng, trace.skewed)
        spec = SessionSpec(rng.randrange(1 << 30), tuple(rng.randint(lo, hi)
                                                         for _ in range(turns)))
        specs.append(spec)
        heapq.heapreplace(free_at, free_at[0] + spec.busy_s(args))
    return specs


def live_context(specs: list[SessionSpec], args: argparse.Namespace, slots: int) -> int:
    """Distinct tokens of the live sessions at a random time (each turn weighted by its time)."""
    weighted = total = 0.0
    obs = sum(args.obs_tokens) / 2
    for spec in specs:
        context = float(args.task_tokens)
        for out in spec.outputs:
            spent = out * args.decode_s_per_token + sum(args.think_s) / 2
            context += out + obs
            weighted += context * spent
            total += spent
    return int(slots * weighted / total + args.engines * args.system_tokens)


@dataclass
class Run:
    calls: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, engine
    prompt: int = 0
    cached: int = 0
    later_calls: int = 0
    switches: int = 0
    overheads_ms: list[float] = field(default_factory=list)
    errors: int = 0


class Perfect:
    """Perfect client-side stickiness: pinned by the client, direct HTTP to the engine."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.live = [0] * len(urls)
        self.pins: dict[str, int] = {}
        self.http = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1024),
                                      headers={"content-type": "application/json"})

    def place(self, avoid: int | None = None) -> int:
        order = [i for i in range(len(self.urls)) if i != avoid]
        best = min(order, key=lambda i: (self.live[i], random.random()))
        self.live[best] += 1
        return best

    async def call(self, key: str, ids: list[int], params: dict[str, Any]
                   ) -> tuple[int, list[int], dict[str, Any]]:
        pin = self.pins.get(key)
        if pin is None:
            pin = self.pins[key] = self.place()
        for _ in range(3):
            body = orjson.dumps({"input_ids": ids, "sampling_params": params})
            reply = await self.http.post(f"{self.urls[pin]}/generate", content=body)
            if reply.status_code == 200:
                out = orjson.loads(reply.content)
                return pin, out["output_ids"], out["meta_info"]
            self.live[pin] -= 1
            pin = self.pins[key] = self.place(avoid=pin)  # the engine failed: re-pin
        raise RuntimeError(f"/generate answered {reply.status_code}")

    async def end(self, key: str) -> None:
        pin = self.pins.pop(key, None)
        if pin is not None:
            self.live[pin] -= 1

    async def close(self) -> None:
        await self.http.aclose()


class ThroughRouter:
    """Riptide's router over gRPC: Generate with the session key, EndSession at the end."""

    def __init__(self, channel: Any, engine_index: dict[str, int]) -> None:
        self.stub = router_pb2_grpc.RouterStub(channel)
        self.engine_index = engine_index

    async def call(self, key: str, ids: list[int], params: dict[str, Any]
                   ) -> tuple[int, list[int], dict[str, Any]]:
        request = router_pb2.GenerateRequest(session_key=key, input_ids=ids,
                                             sampling_params=common_pb2.SamplingParams(**params))
        reply = await self.stub.Generate(request, timeout=60)
        meta = {"prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
                "e2e_latency": reply.engine_latency_s}
        return self.engine_index[reply.engine_url], list(reply.output_ids), meta

    async def end(self, key: str) -> None:
        await self.stub.EndSession(router_pb2.EndSessionRequest(session_key=key), timeout=10)

    async def close(self) -> None:
        pass


class ThroughSglangRouter:
    """The real sglang-router over HTTP, the session key in X-SMG-Routing-Key. It has no
    end-of-session call (its manual policy forgets idle keys)."""

    def __init__(self, url: str, engine_ports: dict[int, int]) -> None:
        self.url = url
        self.engine_ports = engine_ports
        self.http = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1024),
                                      headers={"content-type": "application/json"})

    async def call(self, key: str, ids: list[int], params: dict[str, Any]
                   ) -> tuple[int, list[int], dict[str, Any]]:
        body = orjson.dumps({"input_ids": ids, "sampling_params": params})
        reply = await self.http.post(f"{self.url}/generate", content=body,
                                     headers={"X-SMG-Routing-Key": key})
        if reply.status_code != 200:
            raise RuntimeError(f"/generate answered {reply.status_code}: {reply.text[:200]}")
        out = orjson.loads(reply.content)
        meta = out["meta_info"]
        return self.engine_ports[meta["sim_engine_port"]], out["output_ids"], meta

    async def end(self, key: str) -> None:
        pass

    async def close(self) -> None:
        await self.http.aclose()


async def _session(client: Any, key: str, system: list[int], spec: SessionSpec,
                   args: argparse.Namespace, run: Run) -> None:
    rng = random.Random(spec.seed)
    prompt = system + [rng.randrange(VOCAB) for _ in range(args.task_tokens)]
    previous = -1
    try:
        for out_tokens in spec.outputs:
            params = {"max_new_tokens": out_tokens, "temperature": 1.0, "ignore_eos": True}
            started = time.monotonic()
            try:
                engine, output, meta = await client.call(key, prompt, params)
            except (grpc.aio.AioRpcError, httpx.HTTPError, RuntimeError):
                run.errors += 1
                return
            ended = time.monotonic()
            run.calls.append((started, ended, engine))
            run.prompt += meta["prompt_tokens"]
            run.cached += meta["cached_tokens"]
            run.overheads_ms.append(((ended - started) - meta["e2e_latency"]) * 1000)
            if previous >= 0:
                run.later_calls += 1
                run.switches += engine != previous
            previous = engine
            observation = [rng.randrange(VOCAB) for _ in range(rng.randint(*args.obs_tokens))]
            prompt = prompt + output + observation
            await asyncio.sleep(rng.uniform(*args.think_s))
    finally:
        await client.end(key)


def imbalance(calls: list[tuple[float, float, int]], num_engines: int, t0: float,
              t1: float) -> float:
    """Time-averaged max/mean in-flight calls per engine over [t0, t1] (where any ran)."""
    events = sorted([(s, 1, e) for s, _, e in calls] + [(end, -1, e) for _, end, e in calls])
    load = [0] * num_engines
    weighted = total_time = 0.0
    previous = t0
    for when, delta, engine in events:
        now = min(max(when, t0), t1)
        total = sum(load)
        if now > previous and total:
            weighted += max(load) / (total / num_engines) * (now - previous)
            total_time += now - previous
        previous = max(previous, now)
        load[engine] += delta
    return weighted / total_time if total_time else 0.0


async def _eject_window(engine: SimEngineProcess, pending: list[SessionSpec]) -> None:
    """Fail the engine while the second third of the sessions starts (by progress, not time)."""
    total = len(pending)
    async with httpx.AsyncClient() as http:
        for share, failing in ((2 / 3, True), (1 / 3, False)):
            while len(pending) > total * share:
                await asyncio.sleep(0.05)
            await http.post(f"{engine.url}/sim/control",
                            json={"fail_health": failing, "fail_generate_status": 503 * failing})


async def run_policy(trace: Trace, policy: str, specs: list[SessionSpec],
                     engines: list[SimEngineProcess], router: RouterProcess,
                     args: argparse.Namespace) -> dict[str, Any]:
    urls = [e.url for e in engines]
    async with httpx.AsyncClient() as http:
        for url in urls:
            (await http.post(f"{url}/flush_cache")).raise_for_status()
    if policy not in ("perfect", "sglang_router"):
        router.patch_config(policy=policy)
    rng = random.Random(args.seed)
    system = [rng.randrange(VOCAB) for _ in range(args.system_tokens)]
    slots = args.sessions * trace.sessions_x
    pending = list(reversed(specs))
    run, index = Run(), {url: i for i, url in enumerate(urls)}
    moves_before = router.state().get("spills", 0)
    began = time.monotonic()
    drained_at = [float("inf")]  # when the first slot found no session left

    async def slot(client: Any, i: int) -> None:
        await asyncio.sleep(args.ramp_s * i / slots)
        while pending:
            n = len(pending)
            await _session(client, f"{trace.name}-{policy}-{n}", system, pending.pop(), args,
                           run)
        drained_at[0] = min(drained_at[0], time.monotonic())

    async def drive(client: Any) -> None:
        extra = [_eject_window(engines[-1], pending)] if trace.eject else []
        try:
            await asyncio.gather(*(slot(client, i) for i in range(slots)), *extra)
        finally:
            await client.close()

    if policy == "perfect":
        await drive(Perfect(urls))
    elif policy == "sglang_router":
        with SglangRouterProcess(urls) as reference:
            await drive(ThroughSglangRouter(reference.url, {e.port: i
                                                            for i, e in enumerate(engines)}))
    else:
        async with router.aio_channel() as channel:
            await drive(ThroughRouter(channel, index))
    result = {
        "hit_rate": round(run.cached / run.prompt, 4) if run.prompt else 0.0,
        "imbalance": round(imbalance(run.calls, len(urls), began + args.ramp_s + 1,
                                     drained_at[0]), 3),
        "wall_s": round(time.monotonic() - began, 1),
        "switch_rate": round(run.switches / run.later_calls, 4) if run.later_calls else 0.0,
        "overhead_ms_p50": round(percentile(run.overheads_ms, 0.5), 3),
        "overhead_ms_p99": round(percentile(run.overheads_ms, 0.99), 3),
        "calls": len(run.calls), "errors": run.errors,
    }
    if policy == "sticky_min_load":
        result["load_moves"] = router.state().get("spills", 0) - moves_before
    print(f"{trace.name} {policy}: {result}", flush=True)
    return result


def start_engines(trace: Trace, specs: list[SessionSpec], args: argparse.Namespace
                  ) -> list[SimEngineProcess]:
    cache = args.cache_tokens
    if trace.cache_of_live:
        live = live_context(specs, args, args.sessions * trace.sessions_x)
        cache = int(trace.cache_of_live * live / args.engines)
    engines: list[SimEngineProcess] = []
    try:
        for i in range(args.engines):
            slow = 2.0 if trace.slow_engine and i == args.engines - 1 else 1.0
            engines.append(SimEngineProcess(
                cache_tokens=cache, max_running=args.max_running,
                prefill_s_per_token=args.prefill_s_per_token,
                decode_s_per_token=args.decode_s_per_token * slow))
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def run_trace(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    """Every policy on `trace`, `--repeats` times (seeds --seed, --seed + 1, ...); with
    repeats, each policy's figures are the means, `runs` holds each repeat's, and the target
    compares the default with perfect stickiness repeat by repeat."""
    if args.repeats == 1:
        return _run_trace_once(trace, args)
    runs = [_run_trace_once(trace, argparse.Namespace(**{**vars(args), "seed": args.seed + r}))
            for r in range(args.repeats)]  # fmt: skip
    results: dict[str, Any] = {}
    for policy in args.policies:
        per_run = [run[policy] for run in runs]
        results[policy] = {key: round(statistics.fmean(r[key] for r in per_run), 4)
                           for key in ("hit_rate", "imbalance", "switch_rate",
                                       "overhead_ms_p50", "overhead_ms_p99")}  # fmt: skip
        results[policy]["runs"] = [[r["hit_rate"], r["imbalance"]] for r in per_run]
    if "target" in runs[0]:
        results["target"] = repeated_target([run["sticky_min_load"] for run in runs],
                                            [run["perfect"] for run in runs])  # fmt: skip
    print(f"{trace.name} over {args.repeats} repeats: {results}", flush=True)
    return results


def repeated_target(default: list[dict[str, Any]], perfect: list[dict[str, Any]]
                    ) -> dict[str, Any]:  # fmt: skip
    """The target over paired repeats: the default's mean hit rate over perfect's, and the
    mean difference in imbalance (default - perfect) with a 95% interval (t distribution).
    Met when the hit ratio is at least 0.98 and the imbalance is not shown higher (the
    interval reaches 0 or below); `imbalance_lower` says whether it is shown lower."""
    ratio = statistics.fmean(d["hit_rate"] for d in default) / max(
        statistics.fmean(p["hit_rate"] for p in perfect), 1e-9)
    diffs = [d["imbalance"] - p["imbalance"] for d, p in zip(default, perfect, strict=True)]
    mean = statistics.fmean(diffs)
    half = T95[len(diffs) - 1] * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"hit_vs_perfect": round(ratio, 4), "imbalance_vs_perfect": round(mean, 4),
            "imbalance_vs_perfect_ci95": [round(mean - half, 4), round(mean + half, 4)],
            "imbalance_lower": mean + half < 0,
            "met": ratio >= 0.98 and mean - half <= 0}  # fmt: skip


def _run_trace_once(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    specs = workload(trace, args)
    engines = start_engines(trace, specs, args)
    try:
        knobs = {"session_idle_s": args.session_idle_s, "health_interval_s": 0.5,
                 "health_timeout_s": 0.5,
                 "reprefill_s_per_1k_tokens": args.prefill_s_per_token * 1000}
        with RouterProcess(engine_urls=[e.url for e in engines], **knobs) as router:
            results = {p: asyncio.run(run_policy(trace, p, specs, engines, router, args))
                       for p in args.policies}
    finally:
        for engine in engines:
            engine.stop()
    default, perfect = results.get("sticky_min_load"), results.get("perfect")
    if default and perfect:
        results["target"] = {
            "hit_vs_perfect": round(default["hit_rate"] / max(perfect["hit_rate"], 1e-9), 4),
            "imbalance_vs_perfect": round(default["imbalance"] - perfect["imbalance"], 3),
            "met": default["hit_rate"] >= 0.98 * perfect["hit_rate"]
            and default["imbalance"] <= perfect["imbalance"]}
    return results


async def _calls(send: Any, concurrency: int, num_calls: int) -> list[float]:
    latencies: list[float] = []

    async def worker(w: int) -> None:
        for i in range(num_calls // concurrency):
            started = time.perf_counter()
            await send(f"o-{w}", [(w * 131 + i * 7 + k) % VOCAB for k in range(256)])
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return latencies


async def _overhead_round(engine: SimEngineProcess, router: RouterProcess,
                          reference: SglangRouterProcess | None, concurrency: int,
                          num_calls: int, rounds: int) -> dict[str, Any]:
    params = {"max_new_tokens": 1, "temperature": 0.0}
    # aiohttp for every HTTP path: httpx's own cost at 8 in flight would swamp the figures.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http, \
            router.aio_channel() as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def post(url: str, key: str, ids: list[int]) -> None:
            body = orjson.dumps({"input_ids": ids, "sampling_params": params})
            async with http.post(f"{url}/generate", data=body, headers={
                    "content-type": "application/json", "X-SMG-Routing-Key": key}) as reply:
                await reply.read()
                reply.raise_for_status()

        async def direct(key: str, ids: list[int]) -> None:
            await post(engine.url, key, ids)

        async def front(key: str, ids: list[int]) -> None:
            await post(router.http_url, key, ids)

        async def grpc_call(key: str, ids: list[int]) -> None:
            await stub.Generate(router_pb2.GenerateRequest(
                session_key=key, input_ids=ids,
                sampling_params=common_pb2.SamplingParams(max_new_tokens=1)), timeout=30)

        async def grpc_round_trip(key: str, ids: list[int]) -> None:
            # An RPC that calls no engine: what grpcio's own round trip costs, in this run.
            request = router_pb2.EndSessionRequest(session_key=f"rt-{key}")  # no such session
            await stub.EndSession(request, timeout=30)

        async def sglang_router(key: str, ids: list[int]) -> None:
            assert reference is not None
            await post(reference.url, key, ids)

        paths = {"direct": direct, "http_front": front, "grpc": grpc_call,
                 "grpc_round_trip": grpc_round_trip}
        proxies = {"http_front": router.proc.pid, "grpc": router.proc.pid}
        if reference is not None:
            paths["sglang_router"] = sglang_router
            proxies["sglang_router"] = reference.proc.pid
        for send in paths.values():  # warm connections
            await _calls(send, concurrency, concurrency * 4)
        # Interleaved rounds, so a neighbour's load on this shared machine hits every path.
        per_round: dict[str, list[list[float]]] = {name: [] for name in paths}
        cpu_s = dict.fromkeys(proxies, 0.0)
        for _ in range(rounds):
            for name, send in paths.items():
                before = process_cpu_s(proxies[name]) if name in proxies else 0.0
                per_round[name].append(await _calls(send, concurrency, num_calls // rounds))
                if name in proxies:
                    cpu_s[name] += process_cpu_s(proxies[name]) - before
    samples = {name: [x for r in runs for x in r] for name, runs in per_round.items()}
    direct_p50, direct_p99 = percentile(samples["direct"], 0.5), percentile(samples["direct"], 0.99)
    out: dict[str, Any] = {"direct_ms_p50": round(direct_p50, 3),
                           "direct_ms_p99": round(direct_p99, 3)}
    out["grpc_round_trip_ms_p50"] = round(percentile(samples.pop("grpc_round_trip"), 0.5), 3)
    for name in [p for p in samples if p != "direct"]:
        out[f"{name}_overhead_ms_p50"] = round(percentile(samples[name], 0.5) - direct_p50, 3)
        out[f"{name}_overhead_ms_p99"] = round(percentile(samples[name], 0.99) - direct_p99, 3)
    for name, seconds in cpu_s.items():  # the proxy's own CPU (all its threads) per call
        out[f"{name}_cpu_us_per_call"] = round(seconds / sum(map(len, per_round[name])) * 1e6, 1)
    if reference is not None:
        for name in ("http_front", "grpc"):
            out[f"{name}_vs_sglang_router"] = paired_difference(per_round[name],
                                                                per_round["sglang_router"])
    return out


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    engine = SimEngineProcess(decode_s_per_token=0.0, prefill_s_per_token=0.0)
    reference = SglangRouterProcess([engine.url]) if sglang_router_installed() else None
    try:
        with RouterProcess(engine_urls=[engine.url], http_front=True,
                           event_loop=args.router_event_loop) as router:
            result: dict[str, Any] = {f"concurrency_{c}": asyncio.run(_overhead_round(
                engine, router, reference, c, args.overhead_calls, args.overhead_rounds))
                for c in (1, 8)}  # fmt: skip
    finally:
        if reference is not None:
            reference.stop()
        engine.stop()
    result["router_event_loop"] = args.router_event_loop
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES),
                   help="none given: only the overhead bench")
    p.add_argument("--policies", nargs="+", choices=POLICIES,
                   default=["perfect", "sticky_min_load", "manual", "sglang_router"],
                   help="sglang_router: the real sglang-router, skipped if not installed")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--sessions", type=int, default=32, help="concurrent agent sessions")
    p.add_argument("--duration-s", type=float, default=8.0,
                   help="about this long per trace and policy: sets the number of sessions")
    p.add_argument("--ramp-s", type=float, default=2.0, help="sessions start spread over this")
    p.add_argument("--system-tokens", type=int, default=2048, help="shared system prompt")
    p.add_argument("--task-tokens", type=int, default=512, help="per-session task prompt")
    p.add_argument("--obs-tokens", type=int, nargs=2, default=(16, 64))
    p.add_argument("--think-s", type=float, nargs=2, default=(0.04, 0.16),
                   help="tool time between turns")
    p.add_argument("--cache-tokens", type=int, default=80_000, help="prefix cache per engine")
    p.add_argument("--max-running", type=int, default=24, help="engine calls at once")
    p.add_argument("--session-idle-s", type=float, default=5.0, help="router safety net")
    p.add_argument("--decode-s-per-token", type=float, default=0.002)
    p.add_argument("--prefill-s-per-token", type=float, default=0.00002)
    p.add_argument("--overhead-calls", type=int, default=400, help="0 skips the overhead bench")
    p.add_argument("--overhead-rounds", type=int, default=10, choices=range(2, 12),
                   metavar="2..11", help="interleaved rounds of the overhead bench, each "
                   "path's calls split evenly among them (the paired comparison's samples)")
    p.add_argument("--router-event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the router's [router] event_loop in the overhead bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, choices=range(1, 12),
                   help="runs of each trace (seeds --seed, --seed + 1, ...): means, and the "
                   "target over paired repeats with a 95%% interval")
    args = p.parse_args()
    if 0 < args.overhead_calls < 8 * args.overhead_rounds:
        p.error(f"--overhead-calls: at least 8 x --overhead-rounds ({8 * args.overhead_rounds}), "
                "so every round has a call per worker at concurrency 8")
    if "sglang_router" in args.policies and not sglang_router_installed():
        print("sglang-router is not installed (pip install sglang-router==0.3.2): "
              "its rows and overhead are skipped", flush=True)
        args.policies.remove("sglang_router")

    summary: dict[str, Any] = {name: run_trace(TRACES[name], args) for name in args.traces}
    if args.overhead_calls:
        summary["overhead"] = run_overhead(args)
        print(f"overhead: {summary['overhead']}", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
