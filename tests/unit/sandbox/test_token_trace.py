"""Segments of an episode's tokens: extend where the prompt extends, else open a new one."""

from __future__ import annotations

from services.sandbox.model_client import GenerateResult
from services.sandbox.token_trace import SegmentedTrace


def test_a_prompt_that_extends_appends_only_its_new_tokens() -> None:
    trace = SegmentedTrace()
    assert trace.extend_or_open([1, 2, 3], "history_rewritten") == ""
    trace.segments[0].add_model(GenerateResult([7, 8], [-0.5, -0.25], "stop", 4))
    assert trace.extend_or_open([1, 2, 3, 7, 8, 9, 10], "history_rewritten") == ""
    (segment,) = trace.segments
    assert segment.prompt_ids == [1, 2, 3]
    assert segment.response_ids == [7, 8, 9, 10]
    assert segment.loss_mask == [1, 1, 0, 0]
    assert segment.logprobs == [-0.5, -0.25, 0.0, 0.0]
    assert segment.weight_versions == [4, 4, -1, -1]


def test_a_prompt_that_does_not_extend_opens_a_segment_with_its_cause() -> None:
    trace = SegmentedTrace()
    trace.extend_or_open([1, 2, 3], "history_rewritten")
    trace.segments[0].add_model(GenerateResult([7, 8], [-0.5, -0.25], "stop", 4))
    assert trace.extend_or_open([1, 2, 9], "history_rewritten") == "history_rewritten"
    assert trace.extend_or_open([1, 2], "template_mismatch") == "template_mismatch"
    assert [s.prompt_ids for s in trace.segments] == [[1, 2, 3], [1, 2, 9], [1, 2]]
    assert [s.cause for s in trace.segments] == ["", "history_rewritten", "template_mismatch"]
    assert trace.segments[0].response_ids == [7, 8]  # a closed segment keeps what it had
    assert trace.segments[1].as_segment().cause == "history_rewritten"
