"""Which scaled-dot-product kernel the engine's prefill attention may use.

A prefill's rows attend to their KV slots under a position mask, and its shapes (rows, new
tokens, width) change from call to call. `torch` leaves the choice to torch's dispatcher, which
on an H200 (torch 2.11) picked a kernel that made an eager prefill at an agent's shape 4.2x
slower than the memory-efficient one (`bench/engine_prefill.py`, docs/engine-cuda.md). The
engine's eager prefill on CUDA therefore uses `engine`: the memory-efficient kernel, or the
math one where that cannot run. The other names allow one kernel only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS: dict[str, list[SDPBackend] | None] = {
    "torch": None,
    "engine": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


@contextlib.contextmanager
def prefill_kernels(name: str) -> Iterator[None]:
    """Within the block, masked SDPA runs only on the kernel `name` allows."""
    backends = KERNELS[name]
    if backends is None:
        yield
        return
    with sdpa_kernel(backends):
        yield
