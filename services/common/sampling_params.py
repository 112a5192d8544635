"""SGLang's native `sampling_params` from the proto's SamplingParams.

Shared by every caller of an engine's `/generate`: the router, and the sandbox's direct engine
client (`riptide eval`).
"""

from __future__ import annotations

from typing import Any

from services._proto.riptide.v1 import common_pb2


def sampling_params(params: common_pb2.SamplingParams) -> dict[str, Any]:
    """SGLang sampling_params from the proto (zero means the engine default where noted)."""
    out: dict[str, Any] = {"temperature": params.temperature}
    if params.max_new_tokens:
        out["max_new_tokens"] = params.max_new_tokens
    if params.top_p:
        out["top_p"] = params.top_p
    if params.top_k:
        out["top_k"] = params.top_k
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.ignore_eos:
        out["ignore_eos"] = True
    if params.HasField("sampling_seed"):
        out["sampling_seed"] = params.sampling_seed
    return out
