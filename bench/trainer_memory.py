"""Peak RSS of one trainer step on the CPU: the learning run's shape, fused output or not.

SmolLM2-135M (a Hugging Face folder, `--model`), the trainer's own path (`build_policy` from
a TrainerConfig: megatron model in `--dtype`, MasterAdam with fp32 master weights and
moments, `step.train_step`), one step over `--rows` rows of `--tokens` tokens each (random
ids, random advantages, every token in the loss). Each variant runs in its own process and
reports its peak resident set (ru_maxrss) after the step, the RSS after loading the model
and optimizer (what the step adds is the difference), and the step's wall time:

- `unfused`: logits [tokens, vocab] from the output layer, then chunked log-probs
  (`[trainer.model] fused_output_logprobs = "off"`);
- `fused`: the output layer inside the log-prob chunks (fused_output.py; "on", what "auto"
  picks on the CPU);
- `fused-adaptive-malloc`: `fused` with glibc's own adaptive mmap threshold
  (`[trainer] host_mmap_threshold_mb` unset) instead of the trainer's fixed 1 MiB
  (host_malloc.py): what freed host memory the allocator keeps.

`--micro-tokens`, `--packed`, `--recompute` and `--optimizer-on-disk` set the trainer's
max_tokens_per_microbatch, packed_sequences, full/uniform/1 recomputation and
stream_optimizer_state_to_disk (a temporary folder). The last line printed is the JSON.

    python bench/trainer_memory.py --model DIR [--variants fused,fused-adaptive-malloc]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rss_gib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def child(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    state_dir = tempfile.mkdtemp(prefix="adam-state-")
    try:
        return _step(args, state_dir)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _step(args: argparse.Namespace, state_dir: str) -> dict[str, Any]:
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.data.batch import RolloutBatch, sequence_micro_batches
    from services.trainer.megatron_policy import build_policy
    from services.trainer.objective.loss import LossSettings
    from services.trainer.step import train_step

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    fused = args.variant.startswith("fused")
    model: dict[str, Any] = {"hf_path": str(args.model), "dtype": args.dtype,
                             "fused_output_logprobs": "on" if fused else "off"}
    if args.recompute:
        model |= {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}  # fmt: skip
    optimizer: dict[str, Any] = {}
    if args.optimizer_on_disk:
        optimizer["stream_optimizer_state_to_disk"] = state_dir
    adaptive = args.variant.endswith("adaptive-malloc")
    config = TrainerConfig(model=model, max_tokens_per_microbatch=args.micro_tokens,
                           packed_sequences=args.packed, optimizer=optimizer,
                           host_mmap_threshold_mb=None if adaptive else 1.0)  # fmt: skip
    built = build_policy(config)
    policy = built.policy
    loaded = _rss_gib()
    gen = torch.Generator().manual_seed(0)
    vocab = built.shape.vocab_size
    seqs = [(torch.randint(0, vocab, (args.tokens,), generator=gen).tolist(), [1] * args.tokens)
            for _ in range(args.rows)]  # fmt: skip
    micro = sequence_micro_batches(seqs, args.micro_tokens, packed=args.packed)
    for mb in micro:
        mb.advantages = torch.randn(mb.input_ids.shape, generator=gen) * mb.loss_mask
        mb.rollout_logprobs = torch.full(mb.input_ids.shape, -3.0) * mb.loss_mask
    start = time.perf_counter()
    metrics = train_step(policy, RolloutBatch(micro, [], [], []), LossSettings())
    step_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"peak_rss_gib": round(peak, 2), "rss_after_load_gib": round(loaded, 2),
            "step_s": round(step_s, 1), "micro_batches": len(micro),
            "loss_finite": bool(torch.isfinite(torch.tensor(metrics["loss"])))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path,
                        default=Path.home() / ".cache/riptide/models/smollm2-135m")  # fmt: skip
    parser.add_argument("--variants", default="unfused,fused,fused-adaptive-malloc")
    parser.add_argument("--variant", choices=["unfused", "fused", "fused-adaptive-malloc"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--micro-tokens", type=int, default=4096)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--optimizer-on-disk", action="store_true",
                        help="stream the fp32 master weights and moments through a temp folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)), flush=True)
        return
    shared = ["--model", str(args.model), "--rows", str(args.rows), "--tokens", str(args.tokens),
              "--micro-tokens", str(args.micro_tokens), "--dtype", args.dtype]  # fmt: skip
    shared += ["--packed"] * args.packed + ["--recompute"] * args.recompute
    shared += ["--optimizer-on-disk"] * args.optimizer_on_disk
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results: dict[str, Any] = {"shape": {"rows": args.rows, "tokens": args.tokens,
                                         "micro_tokens": args.micro_tokens, "dtype": args.dtype,
                                         "packed": args.packed, "recompute": args.recompute,
                                         "optimizer_on_disk": args.optimizer_on_disk}}
    for variant in args.variants.split(","):
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, *shared],
                              capture_output=True, text=True, env=env)  # fmt: skip
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:
            results[variant] = {"error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}
        else:
            results[variant] = json.loads(lines[-1])
        print(variant, json.dumps(results[variant]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
