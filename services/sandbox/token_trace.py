"""An episode's tokens with their per-token training data, in one or more segments.

`TokenTrace` is one token sequence: the prompt, then model ids (loss mask 1, the engine's
log-probs and weight version) and context ids (observations, framing: loss mask 0). The
built-in agent builds one; the agent gateway builds one per segment (`SegmentedTrace`): a new
segment opens when a harness's call does not extend the tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services._proto.riptide.v1 import common_pb2
from services.common.routed_experts import RouteChunk, pack_routes, routes_from_int32
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
    #: Routing replay (MoE): (moe_layers, top_k) of the routes asked for, None: not asked.
    route_shape: tuple[int, int] | None = None
    #: The engine's routed experts of the tokens so far, as runs from a token position.
    route_chunks: list[RouteChunk] = field(default_factory=list)
    #: The first position whose routes the next call asks for.
    routed_until: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def ids(self) -> list[int]:
        """Every token so far: what the next model call extends."""
        return self.prompt_ids + self.response_ids

    def is_prefix_of(self, ids: list[int]) -> bool:
        """Whether `ids` starts with every token so far (compared part by part: joining them
        first copies tens of thousands of ids late in an episode)."""
        num_prompt = len(self.prompt_ids)
        return (len(ids) >= self.num_tokens and ids[:num_prompt] == self.prompt_ids
                and ids[num_prompt:self.num_tokens] == self.response_ids)

    @property
    def routes_start(self) -> int | None:
        """Where the next model call asks the engine's routes from (None: not asked)."""
        return None if self.route_shape is None else self.routed_until

    def add_model(self, result: GenerateResult) -> None:
        if self.route_shape is not None and result.routed_experts:
            ids = routes_from_int32(result.routed_experts, *self.route_shape)
            self.route_chunks.append((self.routed_until, ids))
            self.routed_until += len(ids)
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

    def packed_routes(self) -> tuple[bytes, bytes]:
        """(routed_experts, routed_experts_present) of the trajectory format."""
        return pack_routes(self.num_tokens, self.route_chunks)

    def fill(self, trajectory: common_pb2.Trajectory) -> None:
        """The first segment's tokens and routes into `trajectory`."""
        trajectory.prompt_ids.extend(self.prompt_ids)
        trajectory.response_ids.extend(self.response_ids)
        trajectory.loss_mask.extend(self.loss_mask)
        trajectory.rollout_logprobs.extend(self.logprobs)
        trajectory.weight_versions.extend(self.weight_versions)
        if self.route_shape is not None:
            trajectory.routed_experts_num_layers, trajectory.routed_experts_top_k = (
                self.route_shape)
            trajectory.routed_experts, trajectory.routed_experts_present = self.packed_routes()

    def as_segment(self) -> common_pb2.TrajectorySegment:
        routes, present = self.packed_routes() if self.route_shape is not None else (b"", b"")
        return common_pb2.TrajectorySegment(
            prompt_ids=self.prompt_ids, response_ids=self.response_ids, loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs, weight_versions=self.weight_versions,
            cause=self.cause, routed_experts=routes, routed_experts_present=present)


@dataclass
class SegmentedTrace:
    """An episode's segments, in order; the last is the one calls extend."""

    segments: list[TokenTrace] = field(default_factory=list)
    #: (MoE layers, top-k) of the engine's routes each segment records (None: none asked)
    route_shape: tuple[int, int] | None = None

    @property
    def current(self) -> TokenTrace | None:
        return self.segments[-1] if self.segments else None

    def extend_or_open(self, prompt_ids: list[int], cause_if_not: str) -> str:
        """Make `prompt_ids` the current segment's tokens so far: append its new tail where it
        extends them (loss mask 0), else open a new segment whose prompt it is. Returns the
        cause of a segment opened after the first, else ""."""
        current = self.current
        if current is not None:
            if current.is_prefix_of(prompt_ids):
                current.add_context(prompt_ids[current.num_tokens:])
                return ""
        cause = cause_if_not if current is not None else ""
        self.segments.append(TokenTrace(list(prompt_ids), cause=cause,
                                        route_shape=self.route_shape))
        return cause
