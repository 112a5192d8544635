"""How one machine's cores are shared by an engine and a trainer that both run on its CPU.

Each gets half of them (at least one thread). With one torch thread per core in each
process, every parallel region of one waits for a thread the other holds: on two cores a
trainer step beside the decoding engine took 80 s with 2 + 2 threads and 31 s with 1 + 1, and
the engine made 37 against 48 tokens/s (bench/cpu_sharing.py, docs/benchmarks.md).
"""

from __future__ import annotations

import os


def threads_each() -> int:
    """Torch threads for each of an engine and a trainer sharing this machine's CPU."""
    return max(1, len(os.sched_getaffinity(0)) // 2)
