"""Rollout Routing Replay end to end on CPU: a tiny Qwen2-MoE model served by the built-in
engine (bfloat16, as engines run) and trained by the megatron trainer (float32) at identical
weights (bfloat16-representable). The engine returns each token's routed experts; the trainer
replays them. With replay the trainer routes every token exactly as the engine did and the
mismatch KL between the engine's and the trainer's log-probs is lower than without; a sample
without routes trains, routed by the trainer itself, and the fallback is counted
(services/testing/routing_replay.py runs it; bench/routing_replay.py reports it)."""

from __future__ import annotations

import math

import pytest

from services.testing.routing_replay import NUM_LAYERS, measure_replay


@pytest.mark.slow
def test_replay_routes_like_the_engine_and_lowers_mismatch_kl() -> None:
    result = measure_replay()
    print(f"mismatch KL without replay {result['kl']['free']:.3e}, with replay "
          f"{result['kl']['replay']:.3e}; the trainer's own routing differs from the "
          f"engine's on {result['flips']} of {result['num_routed'] * NUM_LAYERS} token-layers")
    routed_positions = [n - 1 for n in result["num_tokens"]]  # the last was never forwarded
    assert result["num_routed"] == sum(routed_positions)
    assert result["mismatched"] == 0  # replayed routes equal the engine's on every token
    assert result["flips"] > 0  # without replay the trainer routes some tokens differently
    assert result["kl"]["replay"] < result["kl"]["free"]
    routed, bare = result["routed_step"], result["bare_step"]
    assert routed["routing_replay_fallback_tokens"] == 0
    assert routed["routing_replay_tokens"] == sum(routed_positions)
    # The bare step trains sample 0 without routes and sample 1 with them.
    assert bare["routing_replay_fallback_tokens"] == routed_positions[0]
    assert bare["routing_replay_tokens"] == routed_positions[1]
    assert bare["num_loss_tokens"] > 0 and math.isfinite(bare["loss"])
