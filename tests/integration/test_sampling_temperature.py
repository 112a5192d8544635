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


def trainer_kls(rank: int, world_size: int, master_port: int, model: str,
                cases: list[tuple[float, list[dict[str, Any]]]]) -> list[float]:
    """For each (temperature, engine samples): the mismatch KL of the engine's log-probs
    against the policy's of a trainer configured with that sampling temperature."""
    from services.common.ports import free_port
    from services.trainer.parallel.parallel import teardown_parallel

    kls = []
    for temperature, samples in cases:
        kls.append(_trainer_kl(model, temperature, samples, free_port()))
        teardown_parallel()
    return kls


def _trainer_kl(model: str, temperature: float, samples: list[dict[str, Any]],
                port: int) -> float:
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.data.batch import MicroBatch
    from services.trainer.megatron_policy import RankAddress, build_policy
    from services.trainer.objective.loss import mismatch_kl

    config = TrainerConfig.model_validate({"model": {"hf_path": model, "dtype": "float32"},
                                           "sampling_temperature": temperature})
    policy = build_policy(config, RankAddress(0, 1, "127.0.0.1", port)).policy
    assert policy.loss_tokens_only  # the masked positions alone are scored
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


def _engine_samples(engine: EngineProcess, temperature: float) -> list[dict[str, Any]]:
    samples = []
    for i, prompt in enumerate(PROMPTS):
        reply = engine.generate(prompt, return_logprob=True, sampling_params={
            "max_new_tokens": 24, "temperature": temperature, "ignore_eos": True,
            "sampling_seed": i})
        samples.append({"prompt": prompt, "output": reply["output_ids"],
                        "logprobs": [e[0] for e in reply["meta_info"]["output_token_logprobs"]]})
    return samples


#: (the temperature the engine sampled at, the one the trainer scores at)
CASES = [(1.0, 1.0), (0.8, 0.8), (0.8, 1.0)]


@pytest.fixture(scope="module")
def kls() -> dict[tuple[float, float], float]:
    """Each case's mismatch KL: one engine samples, one trainer process scores every case."""
    with EngineProcess(tiny_model_path()) as engine:
        samples = {t: _engine_samples(engine, t) for t in {sampled for sampled, _ in CASES}}
    (values,) = run_ranks(Path(__file__), "trainer_kls", 1, {
        "model": str(tiny_model_path()),
        "cases": [(trained, samples[sampled]) for sampled, trained in CASES]}, timeout_s=300)
    return dict(zip(CASES, values, strict=True))


@pytest.mark.slow
def test_engine_and_trainer_agree_at_temperature_one(kls: dict[tuple[float, float], float]) -> None:
    assert kls[1.0, 1.0] < 1e-6


@pytest.mark.slow
def test_engine_and_trainer_agree_at_the_sampling_temperature(
        kls: dict[tuple[float, float], float]) -> None:
    assert kls[0.8, 0.8] < 1e-6


@pytest.mark.slow
def test_scoring_at_another_temperature_shows_the_mismatch(
        kls: dict[tuple[float, float], float]) -> None:
    """The control: the check above sees a trainer that ignores the temperature."""
    assert kls[0.8, 1.0] > 1e-3
