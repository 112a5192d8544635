"""The per-sample record the sandbox publishes: every documented field, tokens aligned."""

from __future__ import annotations

from services._proto.riptide.v1 import common_pb2
from services.common.events import EPISODE_FIELDS
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import AgentRun
from services.sandbox.episode_detail import episode_detail, token_texts
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
    record = episode_detail(trajectory, run, verdict, tokenizer.decode)()
    assert tuple(record) == EPISODE_FIELDS
    assert record["verdict"] == "scored" and record["reward"] == 1.0
    ids = record["tokens"]["ids"]
    assert ids == prompt + response and record["num_prompt_tokens"] == len(prompt)
    assert record["tokens"]["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    assert record["tokens"]["logprobs"] == [0.0] * len(prompt) + [-0.5] * len(response)
    assert "".join(record["token_text"]) == "hils"
    assert record["turns"][0]["observation"] == "a b"


def test_a_character_split_over_byte_tokens_is_shown_whole() -> None:
    """The byte-level tokenizer splits "é" and "→" into 2 and 3 tokens: decoded one by one they
    are replacement characters; the per-token texts give each character to its last byte."""
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("a é → b", add_special_tokens=False)
    assert len(ids) == 10
    assert "\ufffd" in "".join(tokenizer.decode([i]) for i in ids)  # what the view showed
    texts = token_texts(ids, tokenizer.decode)
    assert len(texts) == len(ids) and "".join(texts) == "a é → b"
    assert texts[2:4] == ["", "é"] and texts[5:8] == ["", "", "→"]


def test_invalid_bytes_do_not_hold_back_the_text() -> None:
    """A random model's bytes may never complete a character: after four tokens they are
    shown as decoded, so the rest of the text is not lost."""
    tokenizer = build_tokenizer()
    lone = tokenizer.encode("é", add_special_tokens=False)[0]  # a lead byte alone
    ids = [lone] * 6 + tokenizer.encode("ok", add_special_tokens=False)
    texts = token_texts(ids, tokenizer.decode)
    assert len(texts) == len(ids) and "".join(texts) == tokenizer.decode(ids)
    assert texts[3] != "" and texts[-1] == "k"  # given after four tokens; "ok" is not held
