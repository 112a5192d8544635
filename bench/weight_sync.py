"""Weight sync speed: the trainer's whole sync against a raw broadcast of the same tensors.

The trainer side is the real one: a megatron model built from a Hugging Face folder, and
`DirectEngineWeightSync` gathering Hugging Face-named buckets, posting SGLang's
`/update_weights_from_distributed` to a real built-in engine process and broadcasting each
tensor, which the engine receives and loads. The baseline, measured in the same run, is two
bare processes broadcasting tensors of exactly the same shapes and dtype, one by one, over
the same backend, with no model, HTTP or engine. `sync_vs_raw` = raw seconds / sync seconds
(1.0: the sync costs nothing beyond the broadcast itself). Last line: JSON.

    python bench/weight_sync.py                      # CPU, gloo, a small model
    python bench/weight_sync.py --device cuda        # trainer on cuda:0, engine on cuda:1, NCCL
        [--hidden-size 2048 --num-layers 16 --bucket-mb 2048 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.ports import free_port  # noqa: E402
from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.testing.engine_process import EngineProcess  # noqa: E402
from services.testing.trainer_ranks import run_ranks  # noqa: E402


def raw_worker(
    rank: int, world_size: int, master_port: int, shapes: list[list[int]], dtype: str,
    device: str, repeats: int,
) -> list[float]:
    """Broadcast tensors of `shapes` from rank 0, one by one; seconds per full pass."""
    from datetime import timedelta

    import torch.distributed as dist

    on = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if on.type == "cuda":
        torch.cuda.set_device(on)
    dist.init_process_group("nccl" if on.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))  # fmt: skip
    tensors = [torch.ones(s, dtype=getattr(torch, dtype), device=on) for s in shapes]
    times = []
    for attempt in range(repeats + 1):  # the first pass warms the communicator up
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        if on.type == "cuda":
            torch.cuda.synchronize()
        if attempt:
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def trainer_sync(model_dir: Path, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build the megatron model and time full syncs to the engine at `url`."""
    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import build_model
    from services.trainer.model_config import WeightSyncConfig
    from services.trainer.weights.weight_sync import DirectEngineWeightSync

    config = TrainerConfig.model_validate({"model": {"hf_path": str(model_dir),
                                                     "dtype": args.dtype}})  # fmt: skip
    model, shape, _, backend = build_model(config)
    sync = DirectEngineWeightSync(WeightSyncConfig(
        mode="direct", engine_urls=[url], dtype=args.dtype, bucket_mb=args.bucket_mb,
        master_port=free_port(),
    ), backend)  # fmt: skip
    reports = [sync.sync(model, shape, version) for version in range(1, args.repeats + 2)]
    sync.close()
    timed = reports[1:]  # the first sync also forms the group
    shapes = [list(p.shape) for p in dict(_hf_tensors(model, shape)).values()]
    return {"times": [r.duration_s for r in timed], "bytes": timed[0].num_bytes,
            "tensors": timed[0].num_tensors, "buckets": timed[0].num_buckets, "shapes": shapes,
            "params": sum(p.numel() for p in model.parameters())}


def _hf_tensors(model: Any, shape: Any) -> Any:
    from services.trainer.weights.convert import iter_hf_tensors

    return iter_hf_tensors(model, shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine_args = ["--dtype", args.dtype]
    if args.device == "cuda":
        engine_args += ["--device", "cuda:1"]
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        model_dir = create_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_heads=max(4, args.hidden_size // 128), num_kv_heads=max(2, args.hidden_size // 512),
            intermediate_size=args.hidden_size * 11 // 4,
        )  # fmt: skip
        with EngineProcess(model_dir, extra_args=engine_args, start_timeout_s=600) as engine:
            ours = trainer_sync(model_dir, engine.url, args)
        [raw, _] = run_ranks(Path(__file__), "raw_worker", 2, {
            "shapes": ours["shapes"], "dtype": args.dtype, "device": args.device,
            "repeats": args.repeats,
        }, timeout_s=900)  # fmt: skip
    sync_s, raw_s = statistics.median(ours["times"]), statistics.median(raw)
    gib = ours["bytes"] / 2**30
    print(json.dumps({
        "device": args.device, "params": ours["params"], "gib": round(gib, 3),
        "tensors": ours["tensors"], "buckets": ours["buckets"],
        "sync_s": round(sync_s, 4), "sync_gib_s": round(gib / sync_s, 2),
        "raw_s": round(raw_s, 4), "raw_gib_s": round(gib / raw_s, 2),
        "sync_vs_raw": round(raw_s / sync_s, 3),
    }))


if __name__ == "__main__":
    main()
