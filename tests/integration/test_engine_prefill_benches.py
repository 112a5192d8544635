"""bench/engine_prefill.py and bench/engine_cache_ops.py on CPU at small sizes: each runs every
variant it compares in one process and ends with its JSON (the GPU figures come from the same
code with --device cuda)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _bench(name: str, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(REPO / "bench" / name), *args],
                          capture_output=True, text=True, timeout=600, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_prefill_bench_times_each_kernel_and_the_buckets() -> None:
    result = _bench("engine_prefill.py", "--calls", "6", "--kernels", "torch", "math",
                    "efficient")
    by_kernel = result["by_kernel"]
    for name in ("torch", "math", "graphs"):
        assert by_kernel[name]["wall_ms_p50"] > 0 and by_kernel[name]["host_ms_p50"] > 0
    assert "error" in by_kernel["efficient"]  # no such kernel on the CPU: said, not hidden
    assert by_kernel["graphs"]["captured"] == 0  # no CUDA: the buckets run eagerly
    assert result["speedup_vs_torch_choice"]["torch"] == 1.0


def test_the_cache_ops_bench_times_both_forms() -> None:
    result = _bench("engine_cache_ops.py", "--layers", "2", "--requests", "30",
                    "--conversations", "4", "--prompt-len", "40", "--slot-len", "512",
                    "--dtype", "float32")
    for form in ("per_layer", "stacked"):
        assert result["per_request"][form]["host_us_p50"] > 0
    assert result["stacked_speedup_host"] > 0
