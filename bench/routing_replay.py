"""Rollout Routing Replay on CPU: the mismatch KL between the built-in engine's log-probs
(bfloat16) and the megatron trainer's (float32) at identical weights on a tiny Qwen2-MoE
model (4 MoE layers, 8 experts, top-2), with the trainer routing by itself and replaying the
engine's routed experts. `mismatch_kl` is the k3 estimate over the sampled tokens;
`routing_differs` counts the token-layers whose top-k set differs between the two routings.

Usage: python bench/routing_replay.py [--prompts 6] [--new-tokens 40]
Last line: {"mismatch_kl": {"free": ..., "replay": ...}, "routing_differs": ..., ...}
"""

from __future__ import annotations

import argparse
import json

from services.testing.routing_replay import NUM_LAYERS, measure_replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args()
    result = measure_replay(args.prompts, args.new_tokens)
    print(json.dumps({
        "mismatch_kl": result["kl"],
        "routing_differs": result["flips"],
        "token_layers": result["num_routed"] * NUM_LAYERS,
        "replayed_routes_not_the_engines": result["mismatched"],
        "prompts": args.prompts, "new_tokens": args.new_tokens,
    }))


if __name__ == "__main__":
    main()
