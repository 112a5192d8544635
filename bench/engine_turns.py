"""The built-in engine at an agent's shape: multi-turn episodes against single-turn requests.

An RL episode is a few short turns: each turn's prompt is the previous prompt, what the engine
generated and a command's output, and the reply is a few dozen tokens. The engine then
prefills (mostly from its prefix cache) nearly as often as it decodes, unlike a throughput
bench's long single requests. This bench runs both shapes on one engine in the same run, at
the same concurrency and the same number of generated tokens:

- `turns`: `--concurrency` clients, each running episodes of `--turns` turns (a
  `--prompt-len` prompt, then `--turn-tokens` new tokens a turn after the reply), replies of
  `--max-new-tokens` at T 0.8 with log-probs, as the rollout asks for them;
- `single`: the same clients sending single requests of the first turn's shape.

It reports tokens/s of each and the engine's own mean decode-step interval (its `itl`
histogram), and with `--profile-s S` samples the engine's Python stacks for S seconds with
py-spy (when it is installed) during the multi-turn phase, printing the top frames.

    python bench/engine_turns.py [--shape smollm2-135m] [--device cuda] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_model import build_tokenizer, create_tiny_model  # noqa: E402
from services.testing.engine_process import EngineProcess  # noqa: E402


def create_smollm2_shaped(path: Path) -> Path:
    """A random model of SmolLM2-135M's shape (bf16 on disk) with the tiny byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        tie_word_embeddings=True, eos_token_id=0)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _random(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=gen).tolist()


async def _clients(url: str, args: argparse.Namespace, turns: int) -> dict[str, float]:
    """`args.concurrency` clients, `args.episodes` episodes each of `turns` turns."""
    generated = requests = 0

    async def client(http: httpx.AsyncClient, seed: int) -> None:
        nonlocal generated, requests
        gen = torch.Generator().manual_seed(seed)
        for _ in range(args.episodes):
            ids = _random(gen, args.prompt_len)
            for _turn in range(turns):
                resp = await http.post("/generate", json={
                    "input_ids": ids, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                        "temperature": 0.8, "ignore_eos": True}})
                resp.raise_for_status()
                out = resp.json()
                generated += out["meta_info"]["completion_tokens"]
                requests += 1
                ids = ids + out["output_ids"] + _random(gen, args.turn_tokens)

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, seed) for seed in range(args.concurrency)))
        wall = time.perf_counter() - start
    return {"tokens_per_s": round(generated / wall, 1), "requests": requests,
            "wall_s": round(wall, 2)}


def _itl(url: str) -> tuple[float, float]:
    """The engine's inter-token latency histogram: (sum, count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("inter_token_latency_seconds_sum"):
                total += sample.value
            elif sample.name.endswith("inter_token_latency_seconds_count"):
                count += sample.value
    return total, count


def _phase(engine: EngineProcess, args: argparse.Namespace, turns: int) -> dict[str, Any]:
    before = _itl(engine.url)
    result = asyncio.run(_clients(engine.url, args, turns))
    after = _itl(engine.url)
    steps = after[1] - before[1]
    result["mean_itl_ms"] = round(1000 * (after[0] - before[0]) / steps, 2) if steps else None
    return result


def _profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--idle", "-r", "50", "-d", str(int(seconds)),
                             "-f", "raw", "-o", str(out), "-p", str(pid), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_frames(raw: Path, limit: int = 25) -> list[tuple[str, float]]:
    """The frames present in the largest share of py-spy's collapsed stacks."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        for frame in set(stack.split(";")):
            counts[frame] += int(n)
    return [(frame, round(n / total, 3)) for frame, n in counts.most_common(limit)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smollm2-135m"])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: --shape)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=2, help="episodes a client")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--turn-tokens", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--profile-s", type=float, default=0.0)
    parser.add_argument("--profile-out", type=Path, default=Path("engine-turns-profile.txt"))
    parser.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (create_smollm2_shaped(Path(tmp) / "smollm2")
                               if args.shape == "smollm2-135m"
                               else create_tiny_model(Path(tmp) / "tiny"))
        engine_args = ["--dtype", args.dtype, "--num-threads", str(args.threads), "--device",
                       args.device, "--max-running-requests", str(args.concurrency),
                       *args.engine_args]
        with EngineProcess(model, extra_args=engine_args, start_timeout_s=900) as engine:
            warm = argparse.Namespace(**{**vars(args), "concurrency": 4, "episodes": 1})
            asyncio.run(_clients(engine.url, warm, 2))
            single = _phase(engine, argparse.Namespace(
                **{**vars(args), "episodes": args.episodes * args.turns}), 1)
            print(f"single: {single}", flush=True)
            spy = _profile(engine.proc.pid, args.profile_s, args.profile_out) \
                if args.profile_s else None
            turns = _phase(engine, args, args.turns)
            print(f"turns: {turns}", flush=True)
            if spy is not None:
                spy.wait(timeout=args.profile_s + 30)
    profile = top_frames(args.profile_out) if spy is not None and args.profile_out.exists() \
        else None
    print(json.dumps({
        "model": str(args.model or args.shape), "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda") else "cpu", "dtype": args.dtype,
        "concurrency": args.concurrency, "turns": args.turns, "prompt_len": args.prompt_len,
        "turn_tokens": args.turn_tokens, "max_new_tokens": args.max_new_tokens,
        "single": single, "multi_turn": turns,
        "multi_turn_over_single": round(turns["tokens_per_s"] / single["tokens_per_s"], 3),
        "profile_top_frames": profile}))


if __name__ == "__main__":
    main()
