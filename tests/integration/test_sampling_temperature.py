"""The trainer's log-probs are of the distribution the engine sampled from: at identical
weights in fp32, the mismatch KL between the engine's log-probs of its own samples and the
trainer's policy (`build_policy(config).policy.logprobs`, i.e. ModelPolicy.logprobs) of the
same tokens is below 1e-6, at T = 1 and at the rollout's default T = 0.8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.trainer_ranks import run_ranks

PROMPTS = [[5, 17, 33, 9], [40, 41, 42], [100, 3, 77, 12, 8]]


def trainer_kl(rank: int, world_size: int, master_port: int, model: str, temperature: float,
               samples: list[dict[str, Any]]) -> float:
    """Mismatch KL of the engine's log-probs against the trainer policy's, on the same rows."""
    import torch

    from services.trainer.batch import MicroBatch
    from services.trainer.config import TrainerConfig
    from services.trainer.loss import mismatch_kl
    from services.trainer.megatron_policy import build_policy

    config = TrainerConfig.model_validate({"model": {"hf_path": model, "dtype": "float32"},
                                           "sampling_temperature": temperature})
    policy = build_policy(config).policy
    kls = []
    for s in samples:
        ids = s["prompt"] + s["output"]
        p = len(s["prompt"])
        mask = torch.tensor([[0.0] * p + [1.0] * len(s["output"])])
        engine = torch.tensor([[0.0] * p + s["logprobs"]])
        batch = MicroBatch(torch.tensor([ids]), mask, engine, torch.zeros_like(mask), [len(ids)])
        with torch.no_grad():
            trainer = policy.logprobs(batch)
        kls.append(float(mismatch_kl(trainer, engine, mask)["mismatch_kl"]))
    return max(kls)


def _engine_samples(temperature: float) -> list[dict[str, Any]]:
    with EngineProcess(tiny_model_path()) as engine:
        samples = []
        for i, prompt in enumerate(PROMPTS):
            reply = engine.generate(prompt, return_logprob=True, sampling_params={
                "max_new_tokens": 24, "temperature": temperature, "ignore_eos": True,
                "sampling_seed": i})
            samples.append({"prompt": prompt, "output": reply["output_ids"],
                            "logprobs": [e[0] for e in
                                         reply["meta_info"]["output_token_logprobs"]]})
    return samples


def _kl(sampled_at: float, trained_at: float | None = None) -> float:
    (kl,) = run_ranks(Path(__file__), "trainer_kl", 1, {
        "model": str(tiny_model_path()), "temperature": trained_at or sampled_at,
        "samples": _engine_samples(sampled_at)}, timeout_s=300)
    return float(kl)


@pytest.mark.slow
def test_engine_and_trainer_agree_at_temperature_one() -> None:
    assert _kl(1.0) < 1e-6


@pytest.mark.slow
def test_engine_and_trainer_agree_at_the_sampling_temperature() -> None:
    assert _kl(0.8) < 1e-6


@pytest.mark.slow
def test_scoring_at_another_temperature_shows_the_mismatch() -> None:
    """The control: the check above sees a trainer that ignores the temperature."""
    assert _kl(0.8, trained_at=1.0) > 1e-3
