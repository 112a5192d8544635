"""Throughput of the built-in engine vs plain transformers on CPU.

Generated tokens per second of the built-in engine (a real subprocess, HTTP /generate) at
each concurrency, and of transformers `generate` in this process on the same kind of
requests: one at a time, and as one static batch of the largest concurrency (what a user
would write instead). The tiny random model by default; `--model` takes a Hugging Face
folder (e.g. the cached SmolLM2), with the dtype and threads the learning run uses.
Prints the figures as JSON on its last line.

    python bench/engine.py [--max-new-tokens 64] [--requests-per-client 2]
    python bench/engine.py --model ~/.cache/riptide/models/smollm2-135m --dtype bfloat16 \
        --threads 2 --prompt-len 800 --concurrency 1 8 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.testing.engine_process import EngineProcess  # noqa: E402


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(count)]


async def run_clients(url: str, prompts: list[list[int]], concurrency: int, new: int) -> float:
    """Serve `prompts` with `concurrency` clients; returns generated tokens per second."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    generated = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True},
            }
            resp = await http.post("/generate", json=body)
            resp.raise_for_status()
            generated += resp.json()["meta_info"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return generated / (time.perf_counter() - start)


def transformers_rate(model: torch.nn.Module, batches: list[list[list[int]]], new: int) -> float:
    """Generated tokens per second of `generate` over `batches` (equal-length prompts each)."""
    generated = 0
    start = time.perf_counter()
    for batch in batches:
        ids = torch.tensor(batch)
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new,
            eos_token_id=[],
            pad_token_id=0,
        )
        generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return generated / (time.perf_counter() - start)


def transformers_baselines(
    model_path: Path, args: argparse.Namespace, largest: int
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, args.dtype)
    ).eval()
    one_at_a_time = make_prompts(min(8, largest), args.prompt_len, seed=1)
    batched = make_prompts(largest * args.requests_per_client, args.prompt_len, seed=2)
    groups = [batched[i : i + largest] for i in range(0, len(batched), largest)]
    new = args.max_new_tokens
    with torch.inference_mode():
        sequential = transformers_rate(model, [[p] for p in one_at_a_time], new)
        batched = transformers_rate(model, groups, new)
    return {"sequential": round(sequential, 1), f"batched_c{largest}": round(batched, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: tiny model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or create_tiny_model(Path(tmp) / "tiny")
        engine_args = ["--dtype", args.dtype, "--num-threads", str(args.threads),
                       "--max-running-requests", str(max(args.concurrency))]
        builtin = {}
        with EngineProcess(model_path, extra_args=engine_args) as engine:
            warm = make_prompts(4, args.prompt_len, seed=99)
            asyncio.run(run_clients(engine.url, warm, 4, 8))
            for concurrency in args.concurrency:
                count = concurrency * args.requests_per_client
                prompts = make_prompts(count, args.prompt_len, seed=concurrency)
                rate = asyncio.run(run_clients(engine.url, prompts, concurrency, new))
                builtin[f"c{concurrency}"] = round(rate, 1)
                print(f"builtin c{concurrency}: {rate:.1f} tokens/s", flush=True)
        baselines = transformers_baselines(model_path, args, max(args.concurrency))
        print(f"transformers: {baselines}", flush=True)
    result = {
        "model": str(args.model or "tiny"),
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "max_new_tokens": new,
        "builtin": builtin,
        "transformers": baselines,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
