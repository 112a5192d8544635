"""Checkpoint tensor names onto the engine's in-memory parameters, as SGLang's loader does.

Weight updates name tensors as they appear in a Hugging Face checkpoint (what a trainer's
converter produces and SGLang expects). transformers 5 keeps some of them differently in
memory: the routed experts of an MoE layer are fused into `experts.gate_up_proj`
`[E, 2I, H]` (each expert's gate rows, then its up rows) and `experts.down_proj` `[E, H, I]`,
and Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` live under `mlp`. `CheckpointNames`
resolves a checkpoint name to the view of the parameter it fills: the parameter itself, or
one expert's slice of a fused one. Used by model_runner.py for check_weights/load_weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_to_mlp(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT.match(name)
    if match and match["proj"] in _MIXTRAL_PROJ:
        name = f"{match['prefix']}.{match['index']}.{_MIXTRAL_PROJ[match['proj']]}.weight"
    return name


class CheckpointNames:
    """Resolves checkpoint names against a model's `state_dict(keep_vars=True)`."""

    def __init__(self, parameters: Mapping[str, torch.Tensor]) -> None:
        self.parameters = parameters

    def view(self, name: str) -> torch.Tensor | None:
        """The tensor (or slice of a fused tensor) that checkpoint tensor `name` fills; None
        when the model has no such parameter."""
        if name in self.parameters:
            return self.parameters[name]
        name = _mixtral_to_mlp(name)
        if name in self.parameters:
            return self.parameters[name]
        match = _EXPERT.match(name)
        if match is None:
            return None
        prefix, index, proj = match["prefix"], int(match["index"]), match["proj"]
        fused = self.parameters.get(f"{prefix}.gate_up_proj")
        if proj in ("gate_proj", "up_proj") and fused is not None and index < fused.shape[0]:
            half = fused.shape[1] // 2
            rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
            return fused.data[index, rows]
        down = self.parameters.get(f"{prefix}.down_proj")
        if proj == "down_proj" and down is not None and index < down.shape[0]:
            return down.data[index]
        return None
