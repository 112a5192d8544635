"""An episode's tokens with their per-token training data, in one or more segments.

`TokenTrace` is one token sequence: the prompt, then model ids (loss mask 1, the engine's
log-probs and weight version) and context ids (observations, framing: loss mask 0). The
built-in agent builds one; the agent gateway builds one per segment (`SegmentedTrace`): a new
segment opens when a harness's call does not extend the tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services._proto.riptide.v1 import common_pb2
from services.sandbox.model_client import GenerateResult


@dataclass
class TokenTrace:
    """The episode's token sequence with its per-token training data."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    #: Why this segment was opened (empty for an episode's first).
    cause: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def ids(self) -> list[int]:
        """Every token so far: what the next model call extends."""
        return self.prompt_ids + self.response_ids

    def add_model(self, result: GenerateResult) -> None:
        count = len(result.output_ids)
        logprobs = list(result.output_logprobs[:count])
        logprobs += [0.0] * (count - len(logprobs))
        self.response_ids += result.output_ids
        self.loss_mask += [1] * count
        self.logprobs += logprobs
        self.weight_versions += result.token_versions()

    def add_context(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.weight_versions += [-1] * len(ids)

    def as_segment(self) -> common_pb2.TrajectorySegment:
        return common_pb2.TrajectorySegment(
            prompt_ids=self.prompt_ids, response_ids=self.response_ids, loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs, weight_versions=self.weight_versions,
            cause=self.cause)


@dataclass
class SegmentedTrace:
    """An episode's segments, in order; the last is the one calls extend."""

    segments: list[TokenTrace] = field(default_factory=list)

    @property
    def current(self) -> TokenTrace | None:
        return self.segments[-1] if self.segments else None

    def extend_or_open(self, prompt_ids: list[int], cause_if_not: str) -> str:
        """Make `prompt_ids` the current segment's tokens so far: append its new tail where it
        extends them (loss mask 0), else open a new segment whose prompt it is. Returns the
        cause of a segment opened after the first, else ""."""
        current = self.current
        if current is not None:
            known = current.num_tokens
            if len(prompt_ids) >= known and prompt_ids[:known] == current.ids:
                current.add_context(prompt_ids[known:])
                return ""
        cause = cause_if_not if current is not None else ""
        self.segments.append(TokenTrace(list(prompt_ids), cause=cause))
        return cause
