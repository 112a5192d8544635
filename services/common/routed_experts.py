"""The wire forms of Rollout Routing Replay (R3): which experts the engine routed each token
to, per MoE layer.

SGLang returns them as `meta_info.routed_experts`, base64 of little-endian int32
`[tokens, moe_layers, top_k]` (`decode_sglang_routes`); Router.Generate passes the raw int32
bytes on. A trajectory carries them packed (`pack_routes` / `unpack_routes`, the format of
Trajectory.routed_experts in protos/riptide/v1/common.proto): a presence bitmap over the
tokens `prompt_ids + response_ids` (bit i, LSB first, set when token i has routes) and the
routes of the present tokens in token order, uint8 when every expert id is below 256, else
little-endian uint16. The sandbox packs, the trainer unpacks (-1 where a token has none).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

import numpy as np

from services.common.errors import InvalidRequest

#: A run of routes: (position of its first token, ids [tokens, moe_layers, top_k]).
RouteChunk = tuple[int, np.ndarray]


def decode_sglang_routes(value: str) -> bytes:
    """The raw int32 bytes of SGLang's base64 `meta_info.routed_experts`."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"meta_info.routed_experts is not base64: {exc}") from None
    if len(raw) % 4:
        raise InvalidRequest(f"meta_info.routed_experts holds {len(raw)} bytes, not int32s")
    return raw


def routes_from_int32(raw: bytes, num_layers: int, top_k: int) -> np.ndarray:
    """`[tokens, num_layers, top_k]` from little-endian int32 bytes."""
    ids = np.frombuffer(raw, dtype="<i4")
    width = num_layers * top_k
    if width <= 0 or ids.size % width:
        raise InvalidRequest(f"{ids.size} routed expert ids are not rows of {num_layers} MoE "
                             f"layers x top-{top_k}")
    return ids.reshape(-1, num_layers, top_k)


def pack_routes(num_tokens: int, chunks: list[RouteChunk]) -> tuple[bytes, bytes]:
    """(packed routes, presence bitmap) of `num_tokens` tokens from runs of routes in token
    order, not overlapping (tokens beyond `num_tokens` are dropped)."""
    present = np.zeros(num_tokens, dtype=bool)
    parts: list[np.ndarray] = []
    shape = chunks[0][1].shape[1:] if chunks else ()
    end = 0
    for start, ids in chunks:
        if ids.shape[1:] != shape:
            raise InvalidRequest(f"routed experts of shape {ids.shape[1:]} after {shape}")
        if start < end:
            raise InvalidRequest(f"routed experts from position {start} overlap those before "
                                 f"{end}")
        end = min(num_tokens, start + len(ids))
        if end > start:
            parts.append(ids[: end - start])
            present[start:end] = True
        end = max(end, start)
    routes = np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=np.int64)
    if routes.size and (routes.min() < 0 or routes.max() >= 2**16):
        raise InvalidRequest(f"expert ids out of range [0, 65536): {routes.min()}..{routes.max()}")
    dtype = "u1" if not routes.size or routes.max() < 256 else "<u2"
    return routes.astype(dtype).tobytes(), np.packbits(present, bitorder="little").tobytes()


def unpack_routes(packed: bytes, present_bits: bytes, num_tokens: int, num_layers: int,
                  top_k: int) -> np.ndarray:
    """`[num_tokens, num_layers, top_k]` int32 expert ids, -1 on tokens without routes."""
    out = np.full((num_tokens, num_layers, top_k), -1, dtype=np.int32)
    if not packed:
        return out
    if len(present_bits) != (num_tokens + 7) // 8:
        raise InvalidRequest(f"routed_experts_present holds {len(present_bits)} bytes; "
                             f"{num_tokens} tokens need {(num_tokens + 7) // 8}")
    present = np.unpackbits(np.frombuffer(present_bits, dtype=np.uint8), count=num_tokens,
                            bitorder="little").astype(bool)
    count = int(present.sum()) * num_layers * top_k
    if len(packed) not in (count, 2 * count) or not count:
        raise InvalidRequest(f"routed_experts holds {len(packed)} bytes; {int(present.sum())} "
                             f"tokens x {num_layers} layers x top-{top_k} need {count} (uint8) "
                             f"or {2 * count} (uint16)")
    dtype = "u1" if len(packed) == count else "<u2"
    out[present] = np.frombuffer(packed, dtype=dtype).reshape(-1, num_layers, top_k)
    return out


def moe_route_shape(model_path: str | Path) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of the Hugging Face model folder's config.json, as an
    engine's routes are shaped; None when the model is not MoE (or has no config.json)."""
    file = Path(model_path) / "config.json"
    if not file.is_file():
        return None
    c = json.loads(file.read_text())
    c = c.get("text_config", c)
    num_experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    top_k = c.get("num_experts_per_tok") or 0
    if not num_experts or not top_k:
        return None
    n = int(c["num_hidden_layers"])
    if c.get("mlp_layer_types"):
        moe = [kind == "sparse" for kind in c["mlp_layer_types"]]
    elif "first_k_dense_replace" in c:
        moe = [i >= c["first_k_dense_replace"] for i in range(n)]
    else:  # Qwen-MoE's sparse step and dense-only layers; Mixtral's are all MoE
        step, dense = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
        moe = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    return sum(moe), int(top_k)
