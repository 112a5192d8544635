"""Supervised warm start: next-token NLL on the loss-mask tokens of given token sequences.

The same megatron policy, MasterAdam optimizer (fp32 master weights whatever the parameter
dtype) and checkpoint format as RL (megatron_policy.py, checkpoint.py); only the loss
differs: the token mean of -log p over the tokens whose loss mask is 1, at temperature 1.
Each step takes `batch_size` sequences from a fresh shuffle of the data every epoch. At the
end it writes one trainer checkpoint `<out>/checkpoints/step-<n>` and the weights as a Hugging
Face folder `<out>/hf` (export.py), from which an RL run or `riptide eval` starts.
The sequences are the JSON lines `{ids, loss_mask, ...}` of services/sandbox/warm_start.py.
Called by `riptide sft` (services/cli.py).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.common.config import StrictModel
from services.common.errors import ConfigError

#: Called with each step's record (step, loss, grad_norm, tokens, step_s).
StepLogFn = Callable[[dict[str, float]], None]


class SftConfig(StrictModel):
    """Settings of one supervised warm start."""

    hf_path: str = Field(min_length=1, description="Hugging Face model folder to start from")
    num_steps: int = Field(100, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(8, ge=1, le=65536, description="sequences per step")
    lr: float = Field(1e-5, gt=0, le=1.0, description="Adam learning rate (constant)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled (AdamW) weight decay")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping (None: off)")
    max_tokens_per_microbatch: int = Field(
        4096, ge=16, description="tokens per forward/backward micro-batch (padding counted)"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter dtype of the forward and backward; the optimizer "
        "keeps fp32 master weights either way"
    )
    seed: int = Field(0, ge=0, description="seed of the data order")
    attention_backend: Literal["fused", "local"] = Field("fused",
                                                         description="core attention backend")


def load_sequences(path: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) of each JSON line of `path`; a malformed line is a ConfigError."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such trajectories file")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids, mask = [int(i) for i in row["ids"]], [int(m) for m in row["loss_mask"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: expected {{\"ids\": [...], \"loss_mask\": "
                              f"[...]}}: {type(exc).__name__}: {exc}") from None
        if len(ids) != len(mask) or not any(mask):
            raise ConfigError(f"{path}:{number}: loss_mask needs one entry per id "
                              f"({len(mask)} vs {len(ids)}) and at least one 1")
        out.append((ids, mask))
    if not out:
        raise ConfigError(f"{path}: no sequences")
    return out


def batches(num_sequences: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Indices of each step's sequences: epochs of fresh shuffles, read `batch_size` at a time."""
    rng = random.Random(seed)
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            order = list(range(num_sequences))
            rng.shuffle(order)
            pending += order
        yield pending[:batch_size]
        del pending[:batch_size]


def _trainer_config(config: SftConfig, checkpoint_dir: Path) -> Any:
    from services.trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "model": {"hf_path": config.hf_path, "dtype": config.dtype,
                  "attention_backend": config.attention_backend},
        "optimizer": {"lr": config.lr, "weight_decay": config.weight_decay,
                      "max_grad_norm": config.max_grad_norm},
        "max_tokens_per_microbatch": config.max_tokens_per_microbatch,
        "checkpoint": {"dir": str(checkpoint_dir), "num_kept": 1},
    })  # fmt: skip


def _stderr_log(record: dict[str, float]) -> None:
    print(json.dumps(record), file=sys.stderr, flush=True)


def train_sft(sequences: list[tuple[list[int], list[int]]], config: SftConfig, out: Path,
              on_step: StepLogFn = _stderr_log) -> dict[str, Any]:
    """Train on `sequences`; write the checkpoint and the Hugging Face folder under `out`;
    returns the run's figures (losses by step, tokens, wall time, paths)."""
    import torch

    from services.trainer.data.batch import sequence_micro_batches
    from services.trainer.megatron_policy import build_policy
    from services.trainer.weights.checkpoint import Checkpointer, TrainerState
    from services.trainer.weights.export import write_hf_folder

    started = time.monotonic()
    trainer = _trainer_config(config, out / "checkpoints")
    built = build_policy(trainer)
    policy, device = built.policy, built.device
    losses: list[float] = []
    num_tokens = num_loss_tokens = 0
    order = batches(len(sequences), config.batch_size, config.seed)
    for step in range(1, config.num_steps + 1):
        step_started = time.monotonic()
        picked = [sequences[i] for i in next(order)]
        micro = sequence_micro_batches(picked, config.max_tokens_per_microbatch,
                                       trainer.pad_token_id)
        tokens = sum(mb.num_loss_tokens for mb in micro)
        total = 0.0
        for mb in micro:
            mb = mb.to(device)
            nll = -(policy.logprobs(mb) * mb.loss_mask).sum()
            policy.backward(nll / tokens)  # the token mean over the whole step
            total += float(nll.detach())
        metrics = policy.step()
        losses.append(total / tokens)
        num_loss_tokens += tokens
        num_tokens += sum(len(ids) for ids, _ in picked)
        on_step({"step": step, "loss": losses[-1], "grad_norm": metrics["grad_norm"],
                 "loss_tokens": tokens, "step_s": round(time.monotonic() - step_started, 3)})
    state = TrainerState(step=config.num_steps,
                         num_samples=config.num_steps * config.batch_size, num_tokens=num_tokens)
    checkpoint = Checkpointer(trainer.checkpoint.dir, num_kept=1).save(policy, state)
    with torch.no_grad():
        hf = write_hf_folder(built.model, built.shape, Path(config.hf_path), out / "hf")
    return {
        "steps": config.num_steps, "batch_size": config.batch_size, "lr": config.lr,
        "dtype": config.dtype, "num_sequences": len(sequences),
        "epochs": round(config.num_steps * config.batch_size / len(sequences), 3),
        "initial_loss": losses[0], "final_loss": losses[-1], "losses": losses,
        "num_tokens": num_tokens, "num_loss_tokens": num_loss_tokens,
        "train_s": round(time.monotonic() - started, 2),
        "checkpoint": str(checkpoint), "hf_path": str(hf),
    }
