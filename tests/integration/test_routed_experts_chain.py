"""Routed experts through the whole client chain: a tiny MoE model in the built-in engine
(with --enable-return-routed-experts), the router in its own process, and the sandbox's
RouterModelClient recording a two-turn episode's routes in a TokenTrace. The second turn asks
from where the first ended and still hits the prefix cache up to there; the packed routes
cover every position but the last and agree with a fresh request for the whole sequence."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import pytest

from services.testing.engine_process import EngineProcess
from services.testing.router_process import RouterProcess

pytestmark = pytest.mark.slow
NUM_LAYERS, TOP_K = 2, 2


def test_two_turns_record_every_position_once(tmp_path: Path) -> None:
    from services._proto.riptide.v1 import common_pb2
    from services.common.routed_experts import unpack_routes
    from services.common.tiny_model import create_tiny_model
    from services.sandbox.model_client import RouterModelClient
    from services.sandbox.token_trace import TokenTrace

    model = create_tiny_model(tmp_path / "moe", num_layers=NUM_LAYERS, num_experts=8)
    prompt = [(11 * i) % 200 + 3 for i in range(30)]
    sampling = common_pb2.SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)
    with EngineProcess(model, extra_args=["--enable-return-routed-experts"]) as engine, \
            RouterProcess(engine_urls=[engine.url]) as router:

        async def episode() -> tuple[TokenTrace, list[int]]:
            client = RouterModelClient(router.address, router.grpc_token)
            trace = TokenTrace(list(prompt), route_shape=(NUM_LAYERS, TOP_K))
            starts, cached = [], []
            try:
                for _ in range(2):
                    starts.append(trace.routes_start)
                    result = await client.generate("ep-1", trace.ids, sampling,
                                                   trace.routes_start)
                    cached.append(result.cached_tokens)
                    trace.add_model(result)
                    trace.add_context([5, 6, 7])
            finally:
                await client.close()
            assert starts == [0, len(prompt) + 7 - 1]
            assert cached[1] >= starts[1] - 1  # the cache serves what needs no routes
            return trace, starts

        trace, _ = asyncio.run(episode())
        whole = engine.client.post("/generate", timeout=120, json={
            "input_ids": trace.ids, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).json()
        bad = engine.client.post("/generate", timeout=30, json={
            "input_ids": prompt, "return_routed_experts": True,
            "routed_experts_start_len": len(prompt)})
    assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
    n = trace.num_tokens
    packed, present = trace.packed_routes()
    routes = unpack_routes(packed, present, n, NUM_LAYERS, TOP_K)
    # The context appended after the second turn was never sent: the last routed position
    # is the second turn's last input.
    last = n - 3 - 1
    assert (routes[:last] >= 0).all() and (routes[last:] == -1).all()
    fresh = np.frombuffer(base64.b64decode(whole["meta_info"]["routed_experts"]), "<i4")
    fresh = fresh.reshape(-1, NUM_LAYERS, TOP_K)[:last]
    same = (np.sort(fresh, -1) == np.sort(routes[:last], -1)).all(-1).mean()
    print(f"per-turn routes agree with one whole-sequence prefill on {same:.1%} token-layers")
    assert same >= 0.95
