"""One decode step of a running batch: transformers' DynamicCache vs the engine's in-place KV.

A Hugging Face model (the tiny random one by default; `--model` for a real one) decodes one
token for `--batch` rows that already hold `--width` tokens, through transformers' own
DynamicCache (which concatenates the whole cache every step: what a user of plain
transformers gets) and through the built-in engine's growing cache (services/engine/
kv_storage.py), alternating A/B so machine load falls on both alike. Logits are checked equal.
Last line JSON: median step seconds of each, tokens/s of each, and the speedup.

    python bench/engine_decode.py --model ~/.cache/riptide/models/smollm2-135m \\
        --dtype bfloat16 --threads 2 --batch 8 16 --width 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.engine.kv_storage import growing_cache  # noqa: E402


def one_case(model: Any, batch: int, width: int, steps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch)
    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (batch, width), generator=gen)
        layers = [(layer.keys.clone(), layer.values.clone())
                  for layer in model(input_ids=prompt, use_cache=True,
                                     logits_to_keep=1).past_key_values.layers]
        from transformers import DynamicCache

        caches = {"transformers": DynamicCache(ddp_cache_data=[(k.clone(), v.clone())
                                                               for k, v in layers]),
                  "builtin": growing_cache(layers)}
        times: dict[str, list[float]] = {name: [] for name in caches}
        for step in range(steps + 1):  # the first step warms up, uncounted
            token = torch.randint(0, vocab, (batch, 1), generator=gen)
            mask = torch.ones(batch, width + step + 1, dtype=torch.long)
            positions = torch.full((batch, 1), width + step)
            logits = {}
            for name, cache in caches.items():
                start = time.perf_counter()
                out = model(input_ids=token, position_ids=positions, attention_mask=mask,
                            past_key_values=cache, use_cache=True)
                if step:
                    times[name].append(time.perf_counter() - start)
                logits[name] = out.logits
            if not torch.allclose(logits["builtin"].float(), logits["transformers"].float(),
                                  atol=1e-3, rtol=1e-3):
                raise SystemExit(f"logits differ at batch {batch}, step {step}")
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "step_s": {name: round(value, 4) for name, value in medians.items()},
        "tokens_per_s": {name: round(batch / value, 1) for name, value in medians.items()},
        "speedup": round(medians["transformers"] / medians["builtin"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or create_tiny_model(Path(tmp) / "tiny")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").eval()
    cases = {f"b{b}": one_case(model, b, args.width, args.steps) for b in args.batch}
    for name, case in cases.items():
        print(f"{name}: {case}", flush=True)
    print(json.dumps({"model": str(args.model or "tiny"), "dtype": args.dtype,
                      "threads": args.threads, "width": args.width, "cases": cases}))


if __name__ == "__main__":
    main()
