"""Throughput of the built-in engine vs plain transformers, on CPU or one CUDA GPU.

Generated tokens per second of the built-in engine (a real subprocess, HTTP /generate) at
each concurrency c (c clients, each sending `--requests-per-client` requests one after the
other), and of transformers `generate` in this process on the same kind of requests as static
batches of c prompts (what a user would write instead), with the same weights on the same
device. The tiny random model by default; `--shape qwen2-0.5b` builds a randomly initialised
model of Qwen2-0.5B's shape (no download); `--model` takes a Hugging Face folder.
Prints the figures as JSON on its last line (`speedup`: engine over transformers per c).

    python bench/engine.py [--max-new-tokens 64] [--requests-per-client 2]
    python bench/engine.py --model ~/.cache/riptide/models/smollm2-135m --dtype bfloat16 \
        --threads 2 --prompt-len 800 --concurrency 1 8 16
    python bench/engine.py --device cuda --shape qwen2-0.5b --dtype bfloat16 \
        --prompt-len 512 --max-new-tokens 256 --concurrency 1 16 64 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_model import build_tokenizer, create_tiny_model  # noqa: E402
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


def create_qwen2_shaped(path: Path) -> Path:
    """A random model of Qwen2-0.5B's shape (bf16 on disk) with the tiny byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, eos_token_id=151643,
    )
    torch.manual_seed(0)
    model: Any = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def transformers_rate(
    model: torch.nn.Module, batches: list[list[list[int]]], new: int, device: str
) -> float:
    """Generated tokens per second of `generate` over `batches` (equal-length prompts each)."""
    generated = 0
    start = time.perf_counter()
    for batch in batches:
        ids = torch.tensor(batch, device=device)
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new,
            eos_token_id=[],
            pad_token_id=0,
        )
        generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    if device != "cpu":
        torch.cuda.synchronize()
    return generated / (time.perf_counter() - start)


def transformers_baselines(model_path: Path, args: argparse.Namespace) -> dict[str, float]:
    """transformers' static-batch `generate` at each concurrency: tokens/s by `c<N>`."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    rates = {}
    with torch.inference_mode():
        transformers_rate(model, [make_prompts(2, args.prompt_len, seed=98)], 8, args.device)
        for concurrency in args.concurrency:
            prompts = make_prompts(concurrency * args.requests_per_client, args.prompt_len,
                                   seed=concurrency)
            groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
            rate = transformers_rate(model, groups, args.max_new_tokens, args.device)
            rates[f"c{concurrency}"] = round(rate, 1)
            print(f"transformers c{concurrency}: {rate:.1f} tokens/s", flush=True)
    return rates


def builtin_rates(model_path: Path, args: argparse.Namespace) -> dict[str, float]:
    """The engine's tokens/s at each concurrency, by `c<N>` (one engine for all of them)."""
    engine_args = ["--dtype", args.dtype, "--num-threads", str(args.threads), "--device",
                   args.device, "--max-running-requests", str(max(args.concurrency)),
                   *args.engine_args]
    rates = {}
    with EngineProcess(model_path, extra_args=engine_args, start_timeout_s=900) as engine:
        warm = make_prompts(4, args.prompt_len, seed=99)
        asyncio.run(run_clients(engine.url, warm, 4, 8))
        for concurrency in args.concurrency:
            count = concurrency * args.requests_per_client
            prompts = make_prompts(count, args.prompt_len, seed=concurrency)
            rate = asyncio.run(run_clients(engine.url, prompts, concurrency,
                                           args.max_new_tokens))
            rates[f"c{concurrency}"] = round(rate, 1)
            print(f"builtin c{concurrency}: {rate:.1f} tokens/s", flush=True)
        print(engine.log_tail(3000), file=sys.stderr, flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: --shape)")
    parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen2-0.5b"],
                        help="random model built when --model is not given")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (engine and transformers)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                        help="passed on to the engine (last: everything after it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_path = args.model
        elif args.shape == "qwen2-0.5b":
            model_path = create_qwen2_shaped(Path(tmp) / "qwen2-0.5b-shaped")
        else:
            model_path = create_tiny_model(Path(tmp) / "tiny")
        builtin = builtin_rates(model_path, args)
        baselines = transformers_baselines(model_path, args)
    result = {
        "model": str(args.model or args.shape),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "requests_per_client": args.requests_per_client,
        "engine_args": args.engine_args,
        "builtin": builtin,
        "transformers": baselines,
        "speedup": {c: round(builtin[c] / baselines[c], 2) for c in builtin},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
