"""The built-in engine's prefill forward at an agent's shape, by attention kernel.

An agent's turn is a short new piece (the reply and a command's output, tens of tokens) over a
long cached prefix, a few turns arriving together. The engine prefills such rows as one
right-padded batch attending to its KV slots under a position mask (`SlotModel.prefill`); the
shapes (rows, new tokens, width) differ from call to call. This bench runs one fixed sequence of
such calls, in process, with torch's own choice of scaled-dot-product kernel and with each
kernel forced (`torch.nn.attention.sdpa_kernel`), then as the engine runs them on a GPU:
padded to buckets and replayed as CUDA graphs (`prefill_graphs`; every bucket the calls need is
captured before the timing). It reports per call the wall milliseconds (synchronized) and
the host's milliseconds (CPU time of the calling thread). JSON last.

    python bench/engine_prefill.py --device cuda --shape smollm2-135m --calls 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_turns import create_smollm2_shaped  # noqa: E402

from services.common.tiny_model import create_tiny_model  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.model_runner import ModelRunner  # noqa: E402
from services.engine.prefill_attention import KERNELS, prefill_kernels  # noqa: E402
from services.engine.prefill_graphs import PrefillGraphs  # noqa: E402
from services.engine.slot_batch import SlotBatch  # noqa: E402
from services.engine.slot_model import PrefillRow  # noqa: E402


def workload(calls: int, slots: int, slot_len: int, seed: int = 0) -> list[list[PrefillRow]]:
    """`calls` prefill calls of 1-8 rows, each row 16-128 new tokens over a cached prefix of
    200-1,500 tokens in its own slot (an agent's later turns)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    out = []
    for _ in range(calls):
        rows = []
        for slot in range(pick(1, min(8, slots))):
            n = pick(16, 128)
            start = min(pick(200, 1500), slot_len - n)
            rows.append(PrefillRow(slot, torch.randint(1, 200, (n,), generator=gen).tolist(),
                                   start, all_logits=False))
        out.append(rows)
    return out


def run(prefill: Callable[[list[PrefillRow]], object], calls: list[list[PrefillRow]],
        kernel: str, device: str, warm_up: int = 5) -> dict[str, float]:
    """Per call, the median wall and host milliseconds of `prefill` under `kernel`."""
    walls, hosts = [], []
    with prefill_kernels(kernel):
        for rows in calls[:warm_up]:  # kernels load, caches fill (graphs: captured)
            prefill(rows)
        if device == "cuda":
            torch.cuda.synchronize()
        for rows in calls:
            wall, host = time.perf_counter(), time.thread_time()
            prefill(rows)
            host = time.thread_time() - host
            if device == "cuda":
                torch.cuda.synchronize()
            walls.append(1000 * (time.perf_counter() - wall))
            hosts.append(1000 * host)
    return {"wall_ms_p50": round(statistics.median(walls), 3),
            "wall_ms_mean": round(statistics.fmean(walls), 3),
            "host_ms_p50": round(statistics.median(hosts), 3)}


def graphed(batch: SlotBatch, device: str) -> Callable[[list[PrefillRow]], object]:
    """The engine's bucketed prefill (`prefill_graphs`): replayed CUDA graphs on a GPU."""
    graphs = PrefillGraphs(batch.model, use_graphs=device == "cuda")
    batch.prefill_graphs = graphs
    return batch._prefill_rows


def profile(batch: SlotBatch, calls: list[list[PrefillRow]], kernel: str) -> None:
    from torch.profiler import profile as torch_profile

    with prefill_kernels(kernel), torch_profile() as prof:
        for rows in calls:
            batch.model.prefill(rows)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                    max_name_column_width=60), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smollm2-135m"])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: --shape)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler's busiest host ops of 10 calls per kernel")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS),
                        help="default: every kernel this bench knows (torch's own choice first)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or (create_smollm2_shaped(Path(tmp) / "m") if args.shape != "tiny"
                              else create_tiny_model(Path(tmp) / "m"))
        runner = ModelRunner(EngineConfig(model_path=str(path), dtype=args.dtype,
                                          device=args.device, decode_backend="slots"))
    slot_len = 2048
    batch = SlotBatch(runner, num_slots=9, slot_len=slot_len, cuda_graph=False)
    calls = workload(args.calls, 8, slot_len)
    results: dict[str, object] = {}
    for kernel in args.kernels:
        try:
            results[kernel] = run(batch.model.prefill, calls, kernel, args.device)
        except RuntimeError as error:  # a kernel this GPU or these shapes do not support
            results[kernel] = {"error": str(error).splitlines()[0][:200]}
        print(f"{kernel}: {results[kernel]}", file=sys.stderr, flush=True)
        if args.profile and "error" not in results[kernel]:  # type: ignore[operator]
            profile(batch, calls[:10], kernel)
    # the bucketed graphs, with torch's choice of kernel inside; every bucket captured first
    results["graphs"] = run(graphed(batch, args.device), calls, "torch", args.device,
                            warm_up=len(calls))
    results["graphs"]["captured"] = batch.prefill_graphs.num_graphs  # type: ignore[index,union-attr]
    print(f"graphs: {results['graphs']}", file=sys.stderr, flush=True)
    base = results.get("torch")
    speedups = {k: round(base["wall_ms_mean"] / v["wall_ms_mean"], 3)  # type: ignore[index]
                for k, v in results.items()
                if isinstance(v, dict) and "wall_ms_mean" in v and isinstance(base, dict)
                and "wall_ms_mean" in base}
    print(json.dumps({"model": str(args.model or args.shape), "device": args.device,
                      "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                      "torch": torch.__version__, "dtype": args.dtype, "calls": args.calls,
                      "rows_per_call_mean": round(statistics.fmean(len(c) for c in calls), 2),
                      "by_kernel": results, "speedup_vs_torch_choice": speedups}))


if __name__ == "__main__":
    main()
