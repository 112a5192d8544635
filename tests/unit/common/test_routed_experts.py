"""The routed-experts wire forms: SGLang's base64 int32, and the trajectory's packing."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.common.routed_experts import (
    decode_sglang_routes,
    pack_routes,
    routes_from_int32,
    unpack_routes,
)


def test_sglang_base64_int32_round_trips_to_rows() -> None:
    ids = np.arange(24, dtype="<i4").reshape(4, 3, 2)
    raw = decode_sglang_routes(base64.b64encode(ids.tobytes()).decode())
    assert np.array_equal(routes_from_int32(raw, 3, 2), ids)
    with pytest.raises(InvalidRequest, match="not base64"):
        decode_sglang_routes("not*base64")
    with pytest.raises(InvalidRequest, match="not rows of 3 MoE layers x top-5"):
        routes_from_int32(raw, 3, 5)


def test_packing_keeps_present_tokens_in_uint8_below_256_experts() -> None:
    gen = np.random.default_rng(0)
    early, late = gen.integers(0, 256, (5, 2, 4)), gen.integers(0, 256, (3, 2, 4))
    packed, present = pack_routes(12, [(1, early), (8, late)])
    assert len(packed) == 8 * 2 * 4 and len(present) == 2
    out = unpack_routes(packed, present, 12, 2, 4)
    assert np.array_equal(out[1:6], early) and np.array_equal(out[8:11], late)
    assert (out[[0, 6, 7, 11]] == -1).all()


def test_packing_widens_to_uint16_and_drops_tokens_past_the_end() -> None:
    ids = np.array([[[3, 700]], [[255, 256]]])
    packed, present = pack_routes(1, [(0, ids)])
    assert len(packed) == 2 * 2  # one token kept, uint16
    assert np.array_equal(unpack_routes(packed, present, 1, 1, 2), ids[:1])


def test_unpacking_names_what_does_not_fit() -> None:
    packed, present = pack_routes(4, [(0, np.zeros((4, 2, 2), dtype=int))])
    with pytest.raises(InvalidRequest, match="routed_experts holds 16 bytes"):
        unpack_routes(packed, present, 4, 2, 3)
    with pytest.raises(InvalidRequest, match="20 tokens need 3"):
        unpack_routes(packed, present, 20, 2, 2)
    with pytest.raises(InvalidRequest, match="out of range"):
        pack_routes(1, [(0, np.full((1, 1, 1), -1))])
    assert (unpack_routes(b"", b"", 3, 2, 2) == -1).all()


def test_runs_must_come_in_token_order() -> None:
    with pytest.raises(InvalidRequest, match="from position 2 overlap those before 4"):
        pack_routes(8, [(0, np.zeros((4, 1, 1), dtype=int)), (2, np.zeros((2, 1, 1), dtype=int))])
