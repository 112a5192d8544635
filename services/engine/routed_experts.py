"""Which experts each forwarded token was routed to, for Rollout Routing Replay (R3).

With `enable_return_routed_experts` the model runner installs a forward hook on every MoE
router of the Hugging Face model it serves (transformers' `*TopKRouter` modules, which
return (logits, weights, top-k expert ids)); each forward collects the ids of every MoE
layer, and the scheduler takes them as `[tokens, moe_layers, top_k]` for the requests that
asked (`return_routed_experts`). The response carries them as SGLang does:
`meta_info.routed_experts`, base64 of little-endian int32 `[tokens, moe_layers, top_k]` for
the positions from `routed_experts_start_len` to the last one the engine forwarded (every
token but the final output token). Called by model_runner.py, scheduler.py, generate_io.py.
"""

from __future__ import annotations

import base64
from typing import Any, cast

import torch

from services.common.errors import ConfigError


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (transformers names them `*TopKRouter`)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class RoutedExpertsRecorder:
    """Forward hooks on every MoE router; `take` returns what the last forward routed."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = moe_routers(model)
        if not routers:
            raise ConfigError(
                "enable_return_routed_experts needs an MoE model: "
                f"{type(model).__name__} has no top-k router")
        self.num_layers = len(routers)
        self.top_k = int(cast(Any, routers[0]).top_k)
        self._ids: list[torch.Tensor] = []
        self._forwards: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, module: Any, args: Any, output: Any) -> None:
        self._ids.append(output[-1].detach())

    def clear(self) -> None:
        """Start a forward (what a failed one left behind is dropped)."""
        self._ids = []

    def finish_forward(self) -> None:
        """A forward ended: keep its routes `[tokens, moe_layers, top_k]` for `take_all`."""
        if len(self._ids) != self.num_layers:
            raise RuntimeError(f"recorded {len(self._ids)} MoE layers, the model has "
                               f"{self.num_layers}")
        self._forwards.append(torch.stack(self._ids, dim=1).to(device="cpu", dtype=torch.int32))
        self._ids = []

    def take_all(self) -> list[torch.Tensor]:
        """The routes of each forward since the last call, in order."""
        forwards, self._forwards = self._forwards, []
        return forwards


def encode_routed_experts(rows: list[torch.Tensor]) -> str:
    """SGLang's wire form: base64 of little-endian int32 `[tokens, moe_layers, top_k]`."""
    if not rows:
        return ""
    ids = torch.cat(rows).contiguous().numpy().astype("<i4")
    return base64.b64encode(ids.tobytes()).decode("ascii")
