"""Where a decode step of the built-in engine's scheduler goes, in process (no HTTP).

For each batch size: the whole `Scheduler.step` (median over steps), the forward alone (a
CUDA graph replay on GPU, synchronized), sampling alone on those logits, and the rest (the
scheduler's per-token bookkeeping). Same model options as bench/engine.py. JSON last.

    python bench/engine_step.py --device cuda --shape qwen2-0.5b --dtype bfloat16 \
        --prompt-len 512 --batch 1 16 64 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import create_qwen2_shaped  # noqa: E402

from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.request import GenRequest, SamplingParams  # noqa: E402
from services.engine.sampling import sample_tokens  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of `fn()` over `repeat` calls."""
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def measure(engine: Engine, batch: int, args: argparse.Namespace) -> dict[str, float]:
    sched = engine.schedulers[0]
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist()
        sampling = SamplingParams(max_new_tokens=10_000, temperature=1.0, ignore_eos=True)
        engine.submit(GenRequest(input_ids=prompt, params=sampling))
    while sched.waiting:
        sched.step()
    step = timed(sched.step, args.device, args.steps)
    last = [req.all_ids[-1] for req in sched.running]

    def forward() -> torch.Tensor:
        logits = sched.batch.decode(last)
        sched.batch.lengths = [n - 1 for n in sched.batch.lengths]  # measure, do not advance
        return logits

    logits = forward()
    params = [r.params for r in sched.running]
    streams = [r.generator for r in sched.running]
    result = {
        "step_ms": step,
        "forward_ms": timed(forward, args.device, args.steps),
        "sample_ms": timed(lambda: sample_tokens(logits, params, streams)[0].tolist(),
                           args.device, args.steps),
    }
    result["rest_ms"] = round(step - result["forward_ms"] - result["sample_ms"], 3)
    engine.abort(None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen2-0.5b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--decode-backend", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "qwen2-0.5b":
            path = create_qwen2_shaped(Path(tmp) / "qwen2")
        else:
            path = create_tiny_model(Path(tmp) / "tiny")
        config = EngineConfig(model_path=str(path), device=args.device, dtype=args.dtype,
                              decode_backend=args.decode_backend,
                              max_running_requests=max(args.batch), prefix_cache_num_tokens=0)
        engine = Engine(config)
        results = {}
        for batch in args.batch:
            results[f"b{batch}"] = measure(engine, batch, args)
            print(f"batch {batch}: {results[f'b{batch}']}", flush=True)
    print(json.dumps({"shape": args.shape, "device": args.device, "dtype": args.dtype,
                      "prompt_len": args.prompt_len, "backend": engine.runner.decode_backend,
                      "steps": results}))


if __name__ == "__main__":
    main()
