"""Throughput of the built-in engine vs plain transformers, tiny model on CPU.

Generated tokens per second of the built-in engine (a real subprocess, HTTP /generate) at
concurrency 1, 8 and 32, and of transformers `generate` serving the same requests one at a
time in this process. Prints the figures as JSON on its last line.

    python bench/engine.py [--max-new-tokens 64] [--requests-per-client 2]
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


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (24,), generator=gen).tolist() for _ in range(count)]


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


def transformers_sequential(model_path: Path, prompts: list[list[int]], new: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the engine's default too: best for a tiny model on a busy CPU
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    generated = 0
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new,
            eos_token_id=[],
            pad_token_id=0,
        )
        generated += out.shape[1] - len(prompt)
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    args = parser.parse_args()
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_path = create_tiny_model(Path(tmp) / "tiny")
        builtin = {}
        with EngineProcess(model_path) as engine:
            asyncio.run(run_clients(engine.url, make_prompts(4, seed=99), 4, 8))  # warm up
            for concurrency in (1, 8, 32):
                prompts = make_prompts(concurrency * args.requests_per_client, seed=concurrency)
                rate = asyncio.run(run_clients(engine.url, prompts, concurrency, new))
                builtin[f"c{concurrency}"] = round(rate, 1)
                print(f"builtin c{concurrency}: {rate:.1f} tokens/s", flush=True)
        baseline = transformers_sequential(model_path, make_prompts(8, seed=1), new)
        print(f"transformers sequential: {baseline:.1f} tokens/s", flush=True)
    print(json.dumps({"builtin": builtin, "transformers_sequential": round(baseline, 1)}))


if __name__ == "__main__":
    main()
