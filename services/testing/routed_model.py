"""A mixin for test model clients: routed experts answered as an engine answers them.

For the input positions from the asked `routed_experts_start` through the last position the
engine forwarded (prompt plus output, less the last output id), the expert ids that
`routes_at(positions)` makes ([positions, MoE layers, top-k]), as int32 bytes. Shared by the
built-in agent's and the gateway's tests of routing replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from services._proto.riptide.v1 import common_pb2


class AnswersRoutes:
    """Put before a test ModelClient in the bases; records each call's asked start."""

    def __init__(self, *args: Any, routes_at: Callable[[np.ndarray], np.ndarray],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.routes_at = routes_at
        self.starts: list[int | None] = []

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> Any:
        result = await super().generate(session_key, input_ids, sampling)  # type: ignore[misc]
        self.starts.append(routed_experts_start)
        assert routed_experts_start is not None
        positions = np.arange(routed_experts_start, len(input_ids) + len(result.output_ids) - 1)
        ids = self.routes_at(positions)
        return dataclasses.replace(result, routed_experts=ids.astype("<i4").tobytes())
