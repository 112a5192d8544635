"""SGLang's native `sampling_params` from the proto's SamplingParams.

Shared by every caller of an engine's `/generate`: the router, and the sandbox's direct engine
client (`riptide eval`).
"""

from __future__ import annotations

from typing import Any

from services._proto.riptide.v1 import common_pb2
from services.common.grpc_requests import require

MAX_STOPS = 256
MAX_STOP_CHARS = 1024


def sampling_params(params: common_pb2.SamplingParams) -> dict[str, Any]:
    """SGLang sampling_params from the proto (zero means the engine default where noted; an
    unset max_new_tokens too); InvalidRequest for values no engine accepts, and for an explicit
    max_new_tokens of 0 (the caller would receive no token: proto3 used to read it as unset)."""
    require(not params.HasField("max_new_tokens") or params.max_new_tokens > 0,
            "sampling_params.max_new_tokens: 0 generates nothing; leave it unset for the "
            "default, or give 1 or more")
    require(0 <= params.temperature <= 100, "sampling_params.temperature: must be in [0, 100]")
    require(0 <= params.top_p <= 1, "sampling_params.top_p: must be in [0, 1] (0: default)")
    require(params.top_k >= -1, "sampling_params.top_k: must be -1 (all), 0 (default) or more")
    require(all(t >= 0 for t in params.stop_token_ids),
            "sampling_params.stop_token_ids: token ids are never negative")
    require(len(params.stop_token_ids) <= MAX_STOPS and len(params.stop) <= MAX_STOPS,
            f"sampling_params: at most {MAX_STOPS} stop strings and {MAX_STOPS} stop token ids")
    require(all(0 < len(s) <= MAX_STOP_CHARS for s in params.stop),
            f"sampling_params.stop: each stop string has 1 to {MAX_STOP_CHARS} characters")
    out: dict[str, Any] = {"temperature": params.temperature}
    if params.HasField("max_new_tokens"):
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
