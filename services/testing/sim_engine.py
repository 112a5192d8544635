"""A simulated SGLang-contract engine: exact HTTP shapes, a truthful prefix cache, no model.

Each dp rank has its own LRU radix prefix cache with a token budget, so `cached_tokens` is what
a real engine with that cache would report. Latency is modelled per token (prefill of uncached
prompt tokens, decode of output tokens, optional slowdown with the running batch). Output tokens
are pseudo-random but deterministic in the prompt (and `sampling_seed`). `POST /sim/control`
makes it fail health checks, answer /generate with an error status, or die.

Run: `python -m services.testing.sim_engine --port 0 --ready-file F` (F receives the port).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import os
import random
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.testing.json_http import start_json_server
from services.testing.prefix_cache import PrefixCache


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"object": "error", "message": message, "type": "BadRequestError",
                    "code": status}


@dataclass
class _Rank:
    cache: PrefixCache
    slots: asyncio.Semaphore | None = None  # --max-running: calls beyond it wait
    num_running: int = 0
    num_waiting: int = 0
    num_tokens: int = 0


@dataclass
class _Totals:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    aborted: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class SimEngine:
    """The engine's state and its HTTP handler."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ranks = [_Rank(PrefixCache(args.cache_tokens),
                            asyncio.Semaphore(args.max_running) if args.max_running else None)
                      for _ in range(args.dp_size)]
        self.weight_version: str = args.weight_version
        self.totals = _Totals()
        self.fail_health = False
        self.fail_status = 0
        self.fail_count = 0
        self.context_len = 0  # 0: no limit; else prompts this long are refused (HTTP 400)
        self.running = asyncio.Event()
        self.running.set()
        self.abort_epoch = 0
        self._next_rank = 0
        self.last_request: dict[str, Any] = {}
        self.port = 0  # set once bound; meta_info names it (which engine served a routed call)
        self.served = dict(self.routes)
        if args.contract == "current":  # SGLang 0.5.23's info routes; it keeps the old aliases
            self.served.update({"/model_info": SimEngine.model_info,
                                "/server_info": SimEngine.server_info})
        loads = {"/get_load": SimEngine.get_load, "/v1/loads": SimEngine.v1_loads}
        self.served.pop("/get_load")
        for path in filter(None, args.load_routes.split(",")):
            self.served[path] = loads[path]

    async def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = self.served.get(path)
        if route is None:
            return _error(404, f"no route {method} {path}")
        return await route(self, body or {})

    async def health(self, body: dict[str, Any]) -> tuple[int, Any]:
        return (503, {"status": "unhealthy"}) if self.fail_health else (200, {})

    async def server_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {
            "model_path": "sim", "tp_size": 1, "dp_size": self.args.dp_size,
            "enable_dp_attention": self.args.dp_size > 1 and not self.args.no_dp_attention,
            "max_total_num_tokens": self.args.cache_tokens,
            "max_req_input_len": self.args.max_input_tokens,
            "max_running_requests": self.args.max_running or None,
            "internal_states": [{"dp_rank": i} for i in range(self.args.dp_size)],
            "version": "sim",
        }

    async def model_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": "sim", "tokenizer_path": None, "is_generation": True,
                     "weight_version": self.weight_version}

    async def get_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    async def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("abort_all_requests"):
            self.abort_epoch += 1
        self.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": "ok"}

    async def get_load(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, [{"dp_rank": i, "num_reqs": r.num_running, "num_waiting_reqs": r.num_waiting,
                      "num_tokens": r.num_tokens} for i, r in enumerate(self.ranks)]

    async def v1_loads(self, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang 0.5.23's shape: running and waiting apart, KV tokens as num_used_tokens."""
        return 200, {"timestamp": time.time(), "version": "sim",
                     "dp_rank_count": len(self.ranks), "loads": [
                         {"dp_rank": i, "num_running_reqs": r.num_running,
                          "num_waiting_reqs": r.num_waiting, "num_used_tokens": r.num_tokens,
                          "max_total_num_tokens": self.args.cache_tokens,
                          "token_usage": r.num_tokens / self.args.cache_tokens}
                         for i, r in enumerate(self.ranks)]}

    async def flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        if any(r.num_running for r in self.ranks):
            return _error(400, "cannot flush the cache while requests are running")
        for rank in self.ranks:
            rank.cache.clear()
        return 200, {}

    async def pause(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("mode", "abort") == "abort":
            self.abort_epoch += 1
        self.running.clear()
        return 200, {"status": "ok"}

    async def resume(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.running.set()
        return 200, {"status": "ok"}

    async def control(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("die"):
            os._exit(1)
        self.fail_health = bool(body.get("fail_health", self.fail_health))
        self.fail_status = int(body.get("fail_generate_status", self.fail_status))
        self.fail_count = int(body.get("fail_generate_count", -1 if self.fail_status else 0))
        self.context_len = int(body.get("context_len", self.context_len))
        self.args.decode_s_per_token = float(
            body.get("decode_s_per_token", self.args.decode_s_per_token))
        return 200, {"decode_s_per_token": self.args.decode_s_per_token,
                     "fail_health": self.fail_health, "fail_generate_status": self.fail_status,
                     "context_len": self.context_len}

    async def get_last_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        """The body of the last /generate call, as it arrived (tests check pass-through)."""
        return 200, self.last_request

    async def metrics(self, body: dict[str, Any]) -> tuple[int, Any]:
        t = self.totals
        running = sum(r.num_running for r in self.ranks)
        used = sum(r.cache.num_tokens for r in self.ranks)
        lines = [
            f"sglang:num_running_reqs {running}", "sglang:num_queue_reqs 0",
            f"sglang:num_used_tokens {used}",
            f"sglang:token_usage {used / (self.args.cache_tokens * len(self.ranks)):.6f}",
            f"sglang:max_total_num_tokens {self.args.cache_tokens * len(self.ranks)}",
            f"sglang:prompt_tokens_total {t.prompt_tokens}",
            f"sglang:cached_tokens_total {t.cached_tokens}",
            f"sglang:generation_tokens_total {t.generation_tokens}",
            f"sglang:num_requests_total {t.requests}",
            f"sglang:num_aborted_requests_total {t.aborted}",
        ]
        return 200, "\n".join(lines) + "\n"

    def _pick_rank(self, body: dict[str, Any]) -> int | None:
        rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if rank is None:
            self._next_rank = (self._next_rank + 1) % len(self.ranks)
            return self._next_rank
        return rank if isinstance(rank, int) and 0 <= rank < len(self.ranks) else None

    async def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.fail_status and self.fail_count != 0:
            self.fail_count -= 1
            return _error(self.fail_status, "simulated failure")
        self.last_request = body
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            ids = list(body["text"].encode())  # no tokenizer: one id per byte
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return _error(400, "input_ids must be a non-empty list of token ids")
        if self.context_len and len(ids) >= self.context_len:  # SGLang's own words
            return _error(400, f"The input ({len(ids)} tokens) is longer than the model's "
                               f"context length ({self.context_len} tokens).")
        rank_id = self._pick_rank(body)
        if rank_id is None:
            return _error(400, f"routed_dp_rank out of range (dp_size={len(self.ranks)})")
        params = body.get("sampling_params") or {}
        started = time.monotonic()
        rank = self.ranks[rank_id]
        rank.num_tokens += len(ids)
        try:
            if rank.slots is not None:
                rank.num_waiting += 1
                try:
                    await rank.slots.acquire()
                finally:
                    rank.num_waiting -= 1
            try:
                cached = rank.cache.match(ids)
                output, finish = self._sample(ids, params)
                rank.num_running += 1
                try:
                    output, finish = await self._run(ids, cached, output, finish, rank)
                finally:
                    rank.num_running -= 1
            finally:
                if rank.slots is not None:
                    rank.slots.release()
        finally:
            rank.num_tokens -= len(ids)
        rank.cache.insert(ids + output)
        self._count(len(ids), cached, len(output), finish)
        return 200, self._response(body, ids, cached, output, finish, started)

    def _sample(self, ids: list[int], params: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        seed = params.get("sampling_seed")
        if seed is None:
            seed = zlib.crc32(array.array("q", ids).tobytes())
        rng = random.Random(seed)
        max_new = int(params.get("max_new_tokens", 128))
        stop_ids = set() if params.get("ignore_eos") else set(params.get("stop_token_ids") or ())
        output: list[int] = []
        for _ in range(max_new):
            token = rng.randrange(self.args.vocab_size)
            output.append(token)
            if token in stop_ids:
                return output, {"type": "stop", "matched": token}
        return output, {"type": "length", "length": len(output)}

    async def _run(self, ids: list[int], cached: int, output: list[int],
                   finish: dict[str, Any], rank: _Rank) -> tuple[list[int], dict[str, Any]]:
        a = self.args
        slowdown = 1.0 + a.batch_slowdown * (rank.num_running - 1)
        await asyncio.sleep((len(ids) - cached) * a.prefill_s_per_token * slowdown)
        epoch, step = self.abort_epoch, max(1, len(output) // 4)
        for done in range(0, len(output), step):
            await self.running.wait()
            if self.abort_epoch != epoch:
                return output[:done], {"type": "abort", "message": "aborted by pause"}
            await asyncio.sleep(min(step, len(output) - done) * a.decode_s_per_token * slowdown)
        return output, finish

    def _count(self, prompt: int, cached: int, generated: int, finish: dict[str, Any]) -> None:
        t = self.totals
        t.prompt_tokens += prompt
        t.cached_tokens += cached
        t.generation_tokens += generated
        t.requests += 1
        t.aborted += finish["type"] == "abort"

    def _response(self, body: dict[str, Any], ids: list[int], cached: int, output: list[int],
                  finish: dict[str, Any], started: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": body.get("rid") or uuid.uuid4().hex, "finish_reason": finish,
            "prompt_tokens": len(ids), "completion_tokens": len(output), "cached_tokens": cached,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - started, "total_retractions": 0,
            "sim_engine_port": self.port,
        }
        if body.get("return_logprob"):
            rng = random.Random(len(ids) * 7919 + len(output))
            meta["output_token_logprobs"] = [[-3.0 * rng.random(), t, None] for t in output]
        return {"output_ids": output, "meta_info": meta}

    routes = {
        "/generate": generate, "/health": health, "/health_generate": health,
        "/get_server_info": server_info, "/get_model_info": model_info,
        "/get_weight_version": get_weight_version, "/update_weight_version": update_weight_version,
        "/get_load": get_load, "/flush_cache": flush_cache, "/pause_generation": pause,
        "/continue_generation": resume, "/metrics": metrics, "/sim/control": control,
        "/sim/last_request": get_last_request,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", type=Path, help="write the bound port here once serving")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--no-dp-attention", action="store_true", help="dp ranks are not routable")
    p.add_argument("--cache-tokens", type=int, default=65536, help="prefix cache per dp rank")
    p.add_argument("--prefill-s-per-token", type=float, default=2e-6)
    p.add_argument("--decode-s-per-token", type=float, default=2e-4)
    p.add_argument("--max-running", type=int, default=0,
                   help="calls running at once per dp rank (SGLang's max_running_requests); "
                   "more wait in a queue; 0: no cap")
    p.add_argument("--batch-slowdown", type=float, default=0.0,
                   help="per-token latency grows by this fraction per other running request")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--max-input-tokens", type=int, default=1 << 20,
                   help="the longest prompt it takes (server info's max_req_input_len)")
    p.add_argument("--contract", choices=("deprecated", "current"), default="deprecated",
                   help="info routes: /get_model_info and /get_server_info only, or also "
                   "0.5.23's /model_info and /server_info")
    p.add_argument("--load-routes", default="/get_load",
                   help="comma-separated load routes it serves, of /v1/loads and /get_load "
                   "(empty: none)")
    p.add_argument("--vocab-size", type=int, default=32000)
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    engine = SimEngine(args)
    server = await start_json_server(engine.handle, args.host, args.port)
    port = engine.port = server.sockets[0].getsockname()[1]
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.ready_file)
    print(f"sim engine serving on {args.host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(parse_args()))
