"""A stand-in trainer rank 0: joins a weight-update group and broadcasts a model's weights.

`python -m services.testing.weight_broadcaster --model DIR --master-port P --world-size N`
hosts the group's rendezvous (rank 0), then broadcasts every tensor of the model's state dict
in order, as SGLang's protocol wants, and leaves. Tests post the matching HTTP calls to the
engines meanwhile; `update_request` builds the body of `/update_weights_from_distributed`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch


def load_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return dict(model.state_dict())


def update_request(
    state: dict[str, torch.Tensor], *, dtype: str = "float32", group_name: str, version: str
) -> dict[str, Any]:
    """The `/update_weights_from_distributed` body announcing `state`, in broadcast order."""
    return {
        "names": list(state),
        "dtypes": [dtype] * len(state),
        "shapes": [list(t.shape) for t in state.values()],
        "group_name": group_name,
        "weight_version": version,
        "flush_cache": True,
    }


def main(argv: list[str] | None = None) -> int:
    from services.common.weight_group import (
        broadcast_tensor,
        destroy_process_group,
        init_custom_process_group,
    )

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--master-address", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--group-name", default="weight_update_group")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="where rank 0's tensors live (cuda:N)")
    parser.add_argument("--reversed", action="store_true",
                        help="broadcast in reverse order (a trainer bug the engine must survive)")
    args = parser.parse_args(argv)
    state = load_state_dict(args.model)
    group = init_custom_process_group(
        backend=args.backend,
        init_method=f"tcp://{args.master_address}:{args.master_port}",
        world_size=args.world_size,
        rank=0,
        group_name=args.group_name,
        timeout_s=120,
    )
    dtype = getattr(torch, args.dtype)
    tensors = list(state.values())
    for tensor in reversed(tensors) if args.reversed else tensors:
        broadcast_tensor(tensor.to(device=args.device, dtype=dtype).contiguous(), group)
    print(f"broadcast {len(state)} tensors", flush=True)
    destroy_process_group(group)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
