"""One decode step of a running batch on CPU, each way the engine can run it, against its floor.

A Hugging Face model (the tiny random one by default; `--model` for a real one) decodes one
token for `--batch` rows that already hold `--width` tokens, four ways, alternating A/B/C/D
each step so machine load falls on all alike:

- `transformers`: the model's forward with transformers' own DynamicCache (it concatenates the
  whole cache every step: what a user of plain transformers gets);
- `padded`: the engine's transformers backend (left-padded rows, KV grown in place:
  running_batch.PaddedBatch over kv_storage.py);
- `slots`: the engine's slots backend (a KV slot per row, its own forward: slot_batch.py);
- `slots_gather`: the same forward as it ran on CPU before its eager path (each layer gathers
  the rows' KV by index, widths padded to the CUDA graphs' buckets).

The floor of a step is the slower of reading the weights once (their bytes over the memory
bandwidth, measured in this run as the sum of a 512 MiB tensor) and their matmuls (2 FLOPs per
weight per row, plus attention's, over the peak of a 2048x2048 matmul in the same dtype and
threads; both the best of 10);
`floor_kv_s` also reads every row's KV. Each path's median step is reported as a multiple of
the floor. Logits are checked against `transformers`' (equal for `padded`; for the slots
forward, whose attention is its own, within the dtype's rounding). Last line JSON.

    python bench/engine_decode.py --model ~/.cache/riptide/models/smollm2-135m \\
        --dtype bfloat16 --threads 2 --batch 1 8 16 --width 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.model_runner import ModelRunner  # noqa: E402
from services.engine.running_batch import PaddedBatch  # noqa: E402
from services.engine.slot_batch import SlotBatch  # noqa: E402

# Largest logit difference from transformers' accepted per dtype: the slots forward rounds its
# own attention (bf16 keeps 8 bits: logits near 20 move by a few of its steps of 0.125).
TOLERANCE = {"float32": 1e-3, "bfloat16": 1.0}


def best_s(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine(dtype: torch.dtype) -> dict[str, float]:
    """Memory bandwidth (bytes/s, summing 512 MiB) and matmul peak (FLOP/s) in `dtype`, each
    the best of 10 (a floor takes what the machine can do, not what its neighbours leave)."""
    big = torch.ones(2**29 // dtype.itemsize, dtype=dtype)
    bandwidth = big.numel() * dtype.itemsize / best_s(big.sum, 10)
    del big
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    peak = 2 * 2048**3 / best_s(lambda: a @ b, 10)
    return {"bandwidth_gb_s": round(bandwidth / 1e9, 2), "matmul_gflop_s": round(peak / 1e9, 1)}


def floor(model: Any, batch: int, width: int, rates: dict[str, float]) -> dict[str, float]:
    """The floor of one decode step at `batch` rows of `width` tokens."""
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    matmul_weights = sum({m.weight.data_ptr(): m.weight.numel() for m in model.modules()
                          if isinstance(m, torch.nn.Linear)}.values())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * width
    flops = batch * (2 * matmul_weights + attention)
    kv_bytes = (batch * width * config.num_hidden_layers * 2 * config.num_key_value_heads
                * head_dim * next(iter(params)).element_size())
    bandwidth, peak = rates["bandwidth_gb_s"] * 1e9, rates["matmul_gflop_s"] * 1e9
    return {"weight_bytes": weight_bytes, "flops": flops, "kv_bytes": kv_bytes,
            "floor_s": max(weight_bytes / bandwidth, flops / peak),
            "floor_kv_s": max((weight_bytes + kv_bytes) / bandwidth, flops / peak)}


class GatherSlots(SlotBatch):
    """The slots forward as CPU ran it before its eager path: KV gathered per layer by index,
    widths padded to the graphs' buckets."""

    def _eager_decode(self, last_tokens: list[int]) -> torch.Tensor:
        from services.engine.decode_graphs import width_bucket

        width = width_bucket(max(self.lengths) + 1, self.kv.slot_len)
        return self.model.decode(torch.tensor(last_tokens), torch.tensor(self.lengths),
                                 torch.tensor(self.slots), width)


def one_case(runner: ModelRunner, batch: int, width: int, steps: int) -> dict[str, Any]:
    model = runner.model
    gen = torch.Generator().manual_seed(batch)
    vocab = runner.vocab_size
    slot_len = width + steps + 2
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (batch, width), generator=gen)
        layers = [(layer.keys.clone(), layer.values.clone())
                  for layer in model(input_ids=prompt, use_cache=True,
                                     logits_to_keep=1).past_key_values.layers]
        transformers_cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone())
                                                          for k, v in layers])
        padded = PaddedBatch(runner)
        padded.add_rows([(DynamicCache(ddp_cache_data=[(k[i:i + 1], v[i:i + 1])
                                                       for k, v in layers]), width)
                         for i in range(batch)])
        slots, gather = SlotBatch(runner, batch, slot_len, False), GatherSlots(
            runner, batch, slot_len, False)
        for engine_batch in (slots, gather):
            for i in range(batch):
                slot = engine_batch.kv.allocate()
                engine_batch.kv.write(slot, [(k[i], v[i]) for k, v in layers])
                engine_batch.add_rows([(slot, width)])

        def plain(tokens: list[int], step: int) -> torch.Tensor:
            out = model(input_ids=torch.tensor(tokens)[:, None],
                        position_ids=torch.full((batch, 1), width + step),
                        attention_mask=torch.ones(batch, width + step + 1, dtype=torch.long),
                        past_key_values=transformers_cache, use_cache=True)
            return out.logits[:, -1]

        paths: dict[str, Callable[[list[int], int], torch.Tensor]] = {
            "transformers": plain,
            "padded": lambda tokens, _: padded.decode(tokens),
            "slots": lambda tokens, _: slots.decode(tokens),
            "slots_gather": lambda tokens, _: gather.decode(tokens),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        worst = dict.fromkeys(paths, 0.0)
        for step in range(steps + 1):  # the first step warms up, uncounted
            tokens = torch.randint(0, vocab, (batch,), generator=gen).tolist()
            logits = {}
            for name, path in paths.items():
                start = time.perf_counter()
                logits[name] = path(tokens, step)
                if step:
                    times[name].append(time.perf_counter() - start)
            for name, value in logits.items():
                diff = (value.float() - logits["transformers"].float()).abs().max().item()
                worst[name] = max(worst[name], diff)
    tolerance = TOLERANCE[runner.config.torch_dtype_name]
    # The paths the engine runs must agree; slots_gather (a variant no longer run on CPU) is
    # reported, not required: padding its widths to the graphs' buckets changes its rounding.
    if worst["padded"] > 1e-3 or worst["slots"] > tolerance:
        raise SystemExit(f"logits differ at batch {batch}: {worst}")
    return {name: statistics.median(values) for name, values in times.items()} | {
        "max_logit_diff": {name: round(value, 4) for name, value in worst.items()},
        "outside_tolerance": [name for name, value in worst.items() if value > tolerance]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or create_tiny_model(Path(tmp) / "tiny")
        runner = ModelRunner(EngineConfig(model_path=str(path), dtype=args.dtype,
                                          num_threads=args.threads,
                                          decode_backend="transformers"))
    rates = machine(runner.dtype)
    print(f"machine: {rates}", flush=True)
    cases = {}
    for batch in args.batch:
        measured = one_case(runner, batch, args.width, args.steps)
        bound = floor(runner.model, batch, args.width, rates)
        diffs = measured.pop("max_logit_diff")
        outside = measured.pop("outside_tolerance")
        cases[f"b{batch}"] = {
            "floor_s": round(bound["floor_s"], 5), "floor_kv_s": round(bound["floor_kv_s"], 5),
            "step_s": {name: round(value, 5) for name, value in measured.items()},
            "tokens_per_s": {name: round(batch / value, 1) for name, value in measured.items()},
            "x_floor": {name: round(value / bound["floor_s"], 2)
                        for name, value in measured.items()},
            "slots_speedup_over_padded": round(measured["padded"] / measured["slots"], 2),
            "max_logit_diff": diffs, "outside_tolerance": outside,
            "weight_bytes": bound["weight_bytes"], "kv_bytes": bound["kv_bytes"],
            "flops": bound["flops"]}
        print(f"b{batch}: {cases[f'b{batch}']}", flush=True)
    print(json.dumps({"model": str(args.model or "tiny"), "dtype": args.dtype,
                      "threads": args.threads, "width": args.width, "steps": args.steps,
                      "machine": rates, "cases": cases}))


if __name__ == "__main__":
    main()
