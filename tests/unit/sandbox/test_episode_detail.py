"""The per-sample record the sandbox publishes: every documented field, tokens aligned."""

from __future__ import annotations

from services._proto.riptide.v1 import common_pb2
from services.common.events import EPISODE_FIELDS
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import AgentRun
from services.sandbox.episode_detail import episode_detail
from services.sandbox.token_trace import TokenTrace
from services.sandbox.verifier import Verdict


def test_the_record_has_every_field_and_one_text_per_token() -> None:
    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("hi", add_special_tokens=False)
    response = tokenizer.encode("ls", add_special_tokens=False)
    trajectory = common_pb2.Trajectory(
        sample_id="s", group_id="g", task_id="t", engine_url="http://e", dp_rank=1,
        finish_reason="complete")
    trace = TokenTrace(prompt, response, [1] * len(response), [-0.5] * len(response))
    run = AgentRun(trace, turns=[{"assistant": "ls", "commands": ["ls"], "observation": "a b"}])
    verdict = Verdict(common_pb2.VERDICT_STATUS_SCORED, 1.0, exit_code=0)
    record = episode_detail(trajectory, run, verdict, lambda token: tokenizer.decode([token]))()
    assert tuple(record) == EPISODE_FIELDS
    assert record["verdict"] == "scored" and record["reward"] == 1.0
    ids = record["tokens"]["ids"]
    assert ids == prompt + response and record["num_prompt_tokens"] == len(prompt)
    assert record["tokens"]["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    assert record["tokens"]["logprobs"] == [0.0] * len(prompt) + [-0.5] * len(response)
    assert "".join(record["token_text"]) == "hils"
    assert record["turns"][0]["observation"] == "a b"
