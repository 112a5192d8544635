"""The agent gateway's per-call overhead, against a direct engine call and the router's front.

One simulated engine (no model: its time per call is set, so latency is overhead plus that
time), one router process (`riptide serve router`, gRPC and its SGLang-compatible HTTP front)
and the gateway in a process of its own with its sessions open
(services/testing/gateway_process.py). Paths, interleaved over `--rounds` rounds in the same run:

- `direct`: POST /generate to the engine with the call's token ids;
- `http_front`: the same through the router's HTTP front;
- `proxy_hop`: the same through a pass-through proxy in front of the router's HTTP front
  (services/testing/proxy_hop_process.py: a process of its own on the gateway's HTTP server,
  client and event loop, doing no work): what one more hop costs on this machine;
- `gateway`: POST /sessions/<episode>/v1/chat/completions, as a harness calls it: a growing
  conversation (system prompt, task, then each reply and a short observation; a fresh one
  every `--turns` calls), rendered with the chat template and matched against the episode's
  tokens by the gateway, then the router: by its HTTP front (`--transport http`, what the
  sandbox service uses where the router serves one) or gRPC's Router.Generate (`grpc`).

The direct and front calls carry as many tokens as the gateway's prompt at the same turn.
Three measurements:

- `concurrency_1`: one call at a time, an engine that answers at once: the overhead of a hop.
- `concurrency_32`: 32 harnesses at once, as agents call: the engine takes `--engine-ms` per
  call (a model call of an agent generates tens to thousands of tokens: 100 ms is a short
  one) and each harness runs its command for a random time (exponential, mean `--think-ms`,
  the same sequence on every path) before its next call, so calls do not arrive in lockstep
  and the overhead is each proxy's latency, not the queue of a machine with saturated cores.
- `capacity_32`: 32 at once with an engine that answers at once: the calls per second each
  path sustains and the proxies' CPU per call. On a small machine the bench client, engine,
  router and gateway share the cores, and there every path's latency is its queue: reported,
  not judged.

Per path: p50 and p99 latency, the overhead over the direct call, and the proxies' own CPU
per call; per round, the gateway's p50 minus the front's, whose mean and 95% interval judge
the target (the gateway's overhead at most the front's plus 1 ms: `met` when the interval's
upper end is at most 1 ms, at concurrency 1 and 32). The same paired differences split it:
`proxy_hop_vs_http_front` is what being a separate process costs (any gateway that is a hop
of its own pays it), `gateway_vs_proxy_hop` the gateway's own work (the chat template, the
token matching, the OpenAI shapes). The last line printed is the JSON summary.

    python bench/gateway.py [--calls 1600] [--rounds 8] [--turns 8] [--engine-ms 100] \
        [--think-ms 100] [--gateway-event-loop asyncio|uvloop] [--transport http|grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from services.common.tiny_model import build_tokenizer  # noqa: E402
from services.testing.gateway_process import GatewayProcess  # noqa: E402
from services.testing.latency import paired_difference, percentile, process_cpu_s  # noqa: E402
from services.testing.proxy_hop_process import ProxyHopProcess  # noqa: E402
from services.testing.router_process import RouterProcess  # noqa: E402
from services.testing.sim_engine_process import SimEngineProcess  # noqa: E402

SYSTEM = ("You are an agent in a Linux terminal. Answer with one shell command in a ```bash "
          "block, or say TASK COMPLETE when done. " * 3)
TASK = "Write the number of lines of every .log file under /app/logs to /app/counts.txt. " * 2
OBSERVATION = "exit 0\n/app/logs/a.log 12\n/app/logs/b.log 40\n"


def conversation(turn: int, replies: list[str]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for reply in replies[:turn]:
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": OBSERVATION}]
    return messages


def prompt_lengths(turns: int) -> list[int]:
    """Tokens of the gateway's prompt at each turn (one-token replies, as the engine gives)."""
    tokenizer = build_tokenizer()
    # return_dict=False: transformers 5 returns a mapping (len 2) by default
    return [len(tokenizer.apply_chat_template(conversation(t, ["x"] * t), tokenize=True,
                                              add_generation_prompt=True, return_dict=False))
            for t in range(turns)]


async def _round(paths: dict[str, Any], concurrency: int, calls: int, turns: int,
                 wall: dict[str, float] | None = None, think_s: float = 0.0, seed: int = 0,
                 ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, send in paths.items():
        latencies: list[float] = []
        loop = asyncio.get_running_loop()
        begun = loop.time()

        async def worker(w: int, send: Any = send, latencies: list[float] = latencies) -> None:
            replies: list[str] = []
            think = random.Random(seed * 1000 + w)
            for i in range(calls // concurrency):
                if think_s:
                    await asyncio.sleep(think.expovariate(1 / think_s))
                turn = i % turns
                if turn == 0:
                    replies = []
                started = asyncio.get_running_loop().time()
                reply = await send(w, turn, replies)
                latencies.append((asyncio.get_running_loop().time() - started) * 1000)
                replies.append(reply)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        out[name] = latencies
        if wall is not None:
            wall[name] = wall.get(name, 0.0) + loop.time() - begun
    return out


async def measure(engine: SimEngineProcess, router: RouterProcess, gateway: GatewayProcess,
                  proxy: ProxyHopProcess, concurrency: int, think_s: float,
                  args: argparse.Namespace) -> dict[str, Any]:
    lengths = prompt_lengths(args.turns)
    params = {"max_new_tokens": 1, "temperature": 0.0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def generate(url: str, w: int, turn: int, key_in_body: bool = False) -> str:
            ids = [(w * 131 + turn * 7 + k) % 250 + 3 for k in range(lengths[turn])]
            request: dict[str, Any] = {"input_ids": ids, "sampling_params": params}
            if key_in_body:  # the proxy sends bodies on, not headers
                request["routing_key"] = f"w-{w}"
            body = orjson.dumps(request)
            async with http.post(f"{url}/generate", data=body, headers={
                    "content-type": "application/json",
                    "X-SMG-Routing-Key": f"w-{w}"}) as reply:
                reply.raise_for_status()
                await reply.read()
            return "x"

        async def direct(w: int, turn: int, replies: list[str]) -> str:
            return await generate(engine.url, w, turn)

        async def front(w: int, turn: int, replies: list[str]) -> str:
            return await generate(router.http_url, w, turn)

        async def hop(w: int, turn: int, replies: list[str]) -> str:
            return await generate(proxy.url, w, turn, key_in_body=True)

        async def chat(w: int, turn: int, replies: list[str]) -> str:
            episode = f"bench-{w}"
            body = orjson.dumps({"model": "riptide", "max_tokens": 1,
                                 "messages": conversation(turn, replies)})
            async with http.post(f"{gateway.base_url(episode)}/chat/completions", data=body,
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {gateway.keys[episode]}"}
                                 ) as reply:
                reply.raise_for_status()
                answer = orjson.loads(await reply.read())
            return str(answer["choices"][0]["message"]["content"] or "")

        paths = {"direct": direct, "http_front": front, "proxy_hop": hop, "gateway": chat}
        await _round(paths, concurrency, concurrency * 4, args.turns)  # warm connections
        rounds: dict[str, list[list[float]]] = {name: [] for name in paths}
        procs = {"router": router.proc.pid, "gateway": gateway.proc.pid,
                 "proxy_hop": proxy.proc.pid}
        cpu = dict.fromkeys(procs, 0.0)
        wall: dict[str, float] = {}
        for index in range(args.rounds):
            before = {name: process_cpu_s(pid) for name, pid in procs.items()}
            for name, latencies in (await _round(paths, concurrency, args.calls // args.rounds,
                                                 args.turns, wall, think_s, index)).items():
                rounds[name].append(latencies)
            for name, pid in procs.items():
                cpu[name] += process_cpu_s(pid) - before[name]
    flat = {name: [x for r in runs for x in r] for name, runs in rounds.items()}
    direct_p50, direct_p99 = percentile(flat["direct"], 0.5), percentile(flat["direct"], 0.99)
    out: dict[str, Any] = {"direct_ms_p50": round(direct_p50, 3),
                           "direct_ms_p99": round(direct_p99, 3)}
    for name in paths:
        out[f"{name}_calls_per_s"] = round(len(flat[name]) / wall[name], 1)
    for name in ("http_front", "proxy_hop", "gateway"):
        out[f"{name}_overhead_ms_p50"] = round(percentile(flat[name], 0.5) - direct_p50, 3)
        out[f"{name}_overhead_ms_p99"] = round(percentile(flat[name], 0.99) - direct_p99, 3)
    calls = sum(map(len, rounds["gateway"]))
    # The gateway's process does its own work and waits on the router's gRPC: both count.
    out["gateway_cpu_us_per_call"] = round(cpu["gateway"] / calls * 1e6, 1)
    out["proxy_hop_cpu_us_per_call"] = round(
        cpu["proxy_hop"] / sum(map(len, rounds["proxy_hop"])) * 1e6, 1)
    out["router_cpu_us_per_call_all_paths"] = round(cpu["router"] / sum(
        sum(map(len, rounds[name])) for name in ("http_front", "proxy_hop", "gateway")) * 1e6, 1)
    versus = paired_difference(rounds["gateway"], rounds["http_front"])
    out["gateway_vs_http_front"] = {**versus, "target_ms": 1.0,
                                    "met": versus["ci95_ms"][1] <= 1.0}
    out["proxy_hop_vs_http_front"] = paired_difference(rounds["proxy_hop"], rounds["http_front"])
    out["gateway_vs_proxy_hop"] = paired_difference(rounds["gateway"], rounds["proxy_hop"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1600, help="calls per path and concurrency")
    p.add_argument("--rounds", type=int, default=8, choices=range(2, 12), metavar="2..11")
    p.add_argument("--turns", type=int, default=8, help="calls of one conversation")
    p.add_argument("--engine-ms", type=float, default=100.0,
                   help="the simulated engine's time per call at concurrency 32")
    p.add_argument("--think-ms", type=float, default=100.0,
                   help="mean time a harness spends between calls at concurrency 32")
    p.add_argument("--gateway-event-loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the sandbox service's event_loop (uvloop is its default)")
    p.add_argument("--transport", choices=("http", "grpc"), default="http",
                   help="how the gateway reaches the router: its HTTP front (where the "
                   "deployment serves one, as riptide up does) or gRPC's Router.Generate")
    args = p.parse_args()
    if args.calls < 32 * args.rounds:
        p.error(f"--calls: at least 32 x --rounds ({32 * args.rounds})")
    token = "gateway-bench-token"
    engine = SimEngineProcess(decode_s_per_token=0.0, prefill_s_per_token=0.0)
    try:
        with RouterProcess(engine_urls=[engine.url], http_front=True, grpc_token=token) as router, \
                GatewayProcess(router.address, token, 32, args.gateway_event_loop,
                               router.http_url if args.transport == "http" else "") as gateway, \
                ProxyHopProcess(router.http_url, args.gateway_event_loop) as proxy:
            summary: dict[str, Any] = {}
            for label, concurrency, engine_ms, think_ms in (
                    ("concurrency_1", 1, 0.0, 0.0),
                    ("concurrency_32", 32, args.engine_ms, args.think_ms),
                    ("capacity_32", 32, 0.0, 0.0)):
                engine.control(decode_s_per_token=engine_ms / 1000)  # one token per call
                result = asyncio.run(measure(engine, router, gateway, proxy, concurrency,
                                             think_ms / 1000, args))
                summary[label] = {"engine_ms": engine_ms, "think_ms": think_ms, **result}
                print(f"{label}: {summary[label]}", flush=True)
    finally:
        engine.stop()
    for versus in ("gateway_vs_http_front", "proxy_hop_vs_http_front", "gateway_vs_proxy_hop"):
        summary["capacity_32"].pop(versus)  # saturated cores: not judged
    summary["gateway_event_loop"] = args.gateway_event_loop
    summary["transport"] = args.transport
    summary["met"] = all(summary[f"concurrency_{c}"]["gateway_vs_http_front"]["met"]
                         for c in (1, 32))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
