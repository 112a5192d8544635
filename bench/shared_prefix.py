"""A trainer step on agent groups: shared-prefix rows against padded and packed rows.

Groups shaped like the learning run's (bench/learning.py): `--groups` groups of `--group-size`
samples whose prompt (system prompt and task, `--prompt-tokens`) is the same within a group,
followed by responses of `--response-tokens` on average (uniform from half to one and a half
times that; assistant tokens in the loss, a third of them tool output outside it), random
ids and rewards. Each layout runs in its own process through the trainer's own path
(`build_policy` from a TrainerConfig, SmolLM2-135M in `--dtype`, `pack_groups`,
`step.train_step`), `--steps` steps after one warm-up step, on the same groups:

- `padded`: right-padded rows, `--micro-tokens` a micro-batch (what the learning run used
  before shared prefixes: 1024 puts each sample in its own micro-batch);
- `packed`: samples back to back in rows of at most `--micro-tokens` (THD);
- `shared_prefix`: packed, each group's prompt once per micro-batch (`trainer.shared_prefix`);
- `shared_prefix_every_position`: the same with the output layer and log-probs computed at
  every position, not only the loss tokens' (the trainer before it scored those alone).

Reports per layout the median step time, the tokens computed a step, peak RSS, and the loss
and gradient norm of the first step, which must agree across layouts (the same objective).
The last line printed is the JSON, with each layout's speedup over the first of `--layouts`.

    python bench/shared_prefix.py [--model DIR] [--groups 1] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"padded": {}, "packed": {"packed_sequences": True},
           "shared_prefix": {"packed_sequences": True, "shared_prefix": True},
           "shared_prefix_every_position": {"packed_sequences": True, "shared_prefix": True}}
#: layouts whose policy scores every position (ModelPolicy.loss_tokens_only off)
EVERY_POSITION = {"shared_prefix_every_position"}


def agent_groups(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch

    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory

    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for g in range(args.groups):
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
        samples = []
        for i in range(args.group_size):
            low, high = args.response_tokens // 2, args.response_tokens * 3 // 2
            n = int(torch.randint(low, high + 1, (1,), generator=gen))
            mask = (torch.rand(n, generator=gen) > 1 / 3).int().tolist()
            response = torch.randint(0, vocab, (n,), generator=gen).tolist()
            samples.append(Trajectory(
                prompt_ids=prompt, response_ids=response, loss_mask=mask,
                rollout_logprobs=[-2.0] * n, reward=float(i % 2), status=VERDICT_STATUS_SCORED))
        out.append((f"{g}-0", Group(group_id=f"g{g}", samples=samples)))
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.data.batch import pack_groups
    from services.trainer.megatron_policy import build_policy
    from services.trainer.step import train_step

    torch.set_num_threads(args.threads)
    layout = LAYOUTS[args.layout]
    config = TrainerConfig(model={"hf_path": str(args.model), "dtype": args.dtype},
                           max_tokens_per_microbatch=args.micro_tokens,
                           optimizer={"lr": 1e-7}, **layout)  # fmt: skip
    policy = build_policy(config).policy
    policy.loss_tokens_only = args.layout not in EVERY_POSITION
    groups = agent_groups(args, 49152)
    batch = pack_groups(groups, True, args.micro_tokens, packed=config.packed_sequences,
                        shared_prefix=config.shared_prefix)  # fmt: skip
    first: dict[str, float] = {}
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        metrics = train_step(policy, batch, config.loss.settings())
        if step == 0:
            first = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        else:
            times.append(time.perf_counter() - start)
    return {"step_s": round(statistics.median(times), 3),
            "tokens_computed": sum(mb.input_ids.numel() for mb in batch.micro_batches),
            "sample_tokens": batch.num_tokens, "micro_batches": len(batch.micro_batches),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "first_loss": round(first["loss"], 6), "first_grad_norm": round(first["grad_norm"], 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path,
                        default=Path.home() / ".cache/riptide/models/smollm2-135m")  # fmt: skip
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--layout", choices=list(LAYOUTS))
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=325)
    parser.add_argument("--response-tokens", type=int, default=136)
    parser.add_argument("--micro-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.layout:
        print(json.dumps(child(args)), flush=True)
        return
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("layouts", "layout")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results: dict[str, Any] = {"shape": {k: getattr(args, k) for k in (
        "groups", "group_size", "prompt_tokens", "response_tokens", "micro_tokens", "dtype",
        "threads")}}  # fmt: skip
    for layout in args.layouts.split(","):
        proc = subprocess.run([sys.executable, __file__, *passed, "--layout", layout],
                              capture_output=True, text=True, env=env)  # fmt: skip
        lines = proc.stdout.strip().splitlines()
        results[layout] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                           else {"error": f"exit {proc.returncode}: {proc.stderr[-600:]}"})
        print(layout, json.dumps(results[layout]), flush=True)
    first = args.layouts.split(",")[0]
    base = results.get(first, {}).get("step_s")
    results[f"speedup_over_{first}"] = {
        name: round(base / r["step_s"], 3) for name, r in results.items()
        if base and isinstance(r, dict) and "step_s" in r}  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
