"""The engine's prefix-cache bookkeeping per request, by the form its KV takes.

Every request the engine serves inserts its prompt's KV into the radix cache after prefill and
its whole row's when it finishes; every prompt looks up its longest cached prefix and copies
it into its slot first. At an agent's shape (later turns extend a cached conversation by tens
of tokens) these are short copies: one per layer and per key and value in the per-layer form
(`LayerKV`: 60 for a 30-layer model), one for every layer at once in the stacked form.
`SlotKV.stacked_rows` picks the form the slots hand the cache. This bench times, in process
and in the same run for both forms, one request's cycle: look up the cached conversation,
copy it into a slot, insert the prompt (a new turn of `--turn-tokens`), insert the finished
row (`--reply-tokens` more). It reports host microseconds per cycle (CPU time of the calling
thread) and wall microseconds (synchronized on a GPU), the best of two interleaved passes.
JSON last.

    python bench/engine_cache_ops.py --device cuda --layers 30 --kv-heads 3 --head-dim 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.radix_cache import RadixCache  # noqa: E402
from services.engine.slot_kv import SlotKV  # noqa: E402


def cycle_times(kv: SlotKV, form: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Host and wall microseconds of each request's cache cycle, over `args.requests`."""
    cache = RadixCache(1 << 30)
    kv.stacked_rows = form == "stacked"  # the form the slots hand the cache
    gen = torch.Generator().manual_seed(0)
    conversations = [torch.randint(1, 50_000, (args.prompt_len,), generator=gen).tolist()
                     for _ in range(args.conversations)]
    slot = kv.allocate()
    hosts, walls = [], []
    for i in range(args.requests):
        conversation = conversations[i % len(conversations)]
        turn = torch.randint(1, 50_000, (args.turn_tokens,), generator=gen).tolist()
        reply = torch.randint(1, 50_000, (args.reply_tokens,), generator=gen).tolist()
        prompt = conversation + turn
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall, host = time.perf_counter(), time.thread_time()
        cached, prefix = cache.match_prefix(prompt[:-1])
        if prefix is not None:
            kv.write(slot, prefix)
        cache.insert(prompt, kv.row(slot, len(prompt)))
        finished = prompt + reply
        cache.insert(finished, kv.row(slot, len(finished)))
        host = time.thread_time() - host
        if args.device == "cuda":
            torch.cuda.synchronize()
        if i >= len(conversations):  # the first pass fills the cache
            hosts.append(1e6 * host)
            walls.append(1e6 * (time.perf_counter() - wall))
        conversations[i % len(conversations)] = finished  # the next turn extends it
        if len(finished) + args.turn_tokens + args.reply_tokens > kv.slot_len:
            conversations[i % len(conversations)] = conversation[: args.prompt_len]
    kv.release(slot)
    return hosts, walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--turn-tokens", type=int, default=60)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--slot-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv = SlotKV(num_layers=args.layers, num_slots=2, slot_len=args.slot_len,
                kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                device=torch.device(args.device))
    results: dict[str, dict[str, float]] = {}
    for form in ("per_layer", "stacked", "per_layer", "stacked"):  # interleaved, twice
        hosts, walls = cycle_times(kv, form, args)
        entry = results.setdefault(form, {"host_us_p50": [], "wall_us_p50": []})  # type: ignore[dict-item]
        entry["host_us_p50"].append(statistics.median(hosts))  # type: ignore[attr-defined]
        entry["wall_us_p50"].append(statistics.median(walls))  # type: ignore[attr-defined]
        print(f"{form}: host {statistics.median(hosts):.0f} us, wall "
              f"{statistics.median(walls):.0f} us a request", file=sys.stderr, flush=True)
    summary = {form: {k: round(min(v), 1) for k, v in entry.items()}  # type: ignore[attr-defined]
               for form, entry in results.items()}
    print(json.dumps({
        "device": args.device, "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "prompt_len",
                                                 "turn_tokens", "reply_tokens")},
        "per_request": summary,
        "stacked_speedup_host": round(summary["per_layer"]["host_us_p50"]
                                      / summary["stacked"]["host_us_p50"], 2),
        "stacked_speedup_wall": round(summary["per_layer"]["wall_us_p50"]
                                      / summary["stacked"]["wall_us_p50"], 2)}))


if __name__ == "__main__":
    main()
