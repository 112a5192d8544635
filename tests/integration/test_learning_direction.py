"""The loop moves a policy the right way: a few fully-async steps of the real stack (Redis, the
router, the rollout service with a built-in engine, the trainer, weight syncs) on a task whose
reward depends on one token raise that token's probability; with the reward's sign flipped
(so every advantage is flipped) the same steps lower it. The stand-in sandbox
(services/testing/episode_server.py) makes one-token, model-only episodes."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common import process
from services.common.config import dump_config
from services.local_stack import local_config
from services.testing.engine_process import tiny_model_path
from services.testing.episode_server import prompt_ids

REPO = Path(__file__).resolve().parents[2]
PROMPT = "t:0"
STEPS = 3


def _target_token(model_path: Path) -> tuple[int, float]:
    """The tiny model's likeliest first token after the prompt, and its probability."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    with torch.no_grad():
        probs = model(torch.tensor([prompt_ids(PROMPT)])).logits[0, -1].softmax(-1)
    return int(probs.argmax()), float(probs.max())


def _until(probe: Callable[[], Any], what: str, logs: Path, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = probe()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    tails = {p.name: p.read_text(errors="replace")[-1500:] for p in logs.glob("*.log")}
    raise AssertionError(f"timed out waiting for {what}; logs: {tails}")


def _token_probability(engine_url: str, token: int, api_key: str | None) -> float:
    prompt = prompt_ids(PROMPT)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.post(f"{engine_url}/generate", timeout=60, headers=headers, json={
        "input_ids": [*prompt, token], "return_logprob": True,
        "logprob_start_len": len(prompt), "sampling_params": {"max_new_tokens": 1,
                                                              "temperature": 1.0}}).json()
    return math.exp(reply["meta_info"]["input_token_logprobs"][0][0])


@pytest.mark.slow
@pytest.mark.timeout(600)  # a whole stack for three steps: minutes on a busy 2-core machine
@pytest.mark.parametrize("reward_scale", [1.0, -1.0], ids=["rewarded", "sign-flipped"])
def test_steps_move_the_rewarded_token_the_advantage_s_way(tmp_path: Path,
                                                           reward_scale: float) -> None:
    from services.testing.redis_server import RedisServer

    model = tiny_model_path()
    token, p_model = _target_token(model)
    assert 0.05 < p_model < 0.5, "the target token must be sampled often enough to learn from"
    logs = tmp_path / "logs"
    with RedisServer() as redis_server:
        config = local_config(tmp_path, {
            "redis": redis_server.config.model_dump(exclude_none=True),
            "rollout": {"task_ids": ["t"], "scheduler": {
                "max_concurrent_samples": 32, "n_samples_per_prompt": 16,
                "num_groups_per_batch": 2, "max_new_tokens": 1, "max_staleness": 1,
                # Kept, so the steps come whatever the groups hold: once the penalised token's
                # probability nears 0, every group is all-0 and dropping them would starve the
                # trainer. A zero-variance group has advantage 0 and moves nothing.
                "drop_zero_variance_groups": False},
                "fleet": {"model_path": str(model), "log_dir": str(logs)}},
            "trainer": {"model": {"hf_path": str(model)}, "optimizer": {"lr": 0.02}},
        })
        path = tmp_path / "config.toml"
        path.write_text(dump_config(config))
        headers = {"Authorization": f"Bearer {config.run.admin_token}"}

        def details(name: str) -> dict[str, Any]:
            url = f"{getattr(config, name).admin_url}/admin/state"
            return dict(httpx.get(url, headers=headers, timeout=5).json().get("details") or {})

        children = [process.spawn(
            [sys.executable, "-m", "services.testing.episode_server", "--port",
             str(config.sandbox.grpc_port), "--router", config.router.grpc_address,
             "--tasks", "t", "--turns", "1", "--observation-tokens", "0", "--prompt", PROMPT,
             "--reward-token", str(token), "--reward-scale", str(reward_scale)],
            log_path=logs / "sandbox.log", cwd=REPO,
            env={**os.environ, "RIPTIDE_GRPC_TOKEN": config.run.grpc_token or ""})]
        try:
            def serve(name: str) -> None:
                children.append(process.spawn(
                    [sys.executable, "-m", "services.cli", "serve", name, "--config", str(path)],
                    log_path=logs / f"{name}.log", cwd=REPO))
                admin = getattr(config, name).admin_url
                _until(lambda: httpx.get(f"{admin}/readyz", timeout=2).status_code == 200,
                       f"{name} ready", logs)

            serve("router")
            serve("rollout")
            engine = _until(lambda: details("rollout").get("engines"), "an engine", logs)[0]
            # Probed before the trainer starts, so no step can have reached the engine yet.
            before = _token_probability(engine["url"], token, config.run.engine_api_key)
            serve("trainer")
            _until(lambda: int(details("trainer").get("step", -1)) >= STEPS, f"{STEPS} steps",
                   logs, timeout_s=420)
            _until(lambda: details("rollout")["engines"][0]["weight_version"] >= STEPS,
                   "the engine at the trained weights", logs)
            after = _token_probability(engine["url"], token, config.run.engine_api_key)
        finally:
            for child in reversed(children):
                process.stop(child)
    assert before == pytest.approx(p_model, rel=1e-3), "the engine serves the initial weights"
    # Rewarding the token must raise its probability; penalising it must lower it.
    assert (after - before) * reward_scale > 0.02, (before, after)
