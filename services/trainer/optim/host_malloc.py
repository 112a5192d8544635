"""glibc malloc's mmap threshold, fixed: freed host tensors go back to the operating system.

glibc serves a request below its mmap threshold from its heaps, and raises the threshold (up
to 32 MiB) whenever a larger mapped block is freed. A training step on the CPU allocates and
frees activations, gradients and log-prob temporaries of a few to tens of MiB by the
thousand: after the first frees they all come from the heaps, whose free space fragments and
is kept, and the process holds about 1 GiB more than it uses (SmolLM2-135M in fp32,
bench/trainer_memory.py). `mallopt(M_MMAP_THRESHOLD)` fixes the threshold, which also turns
the adjustment off: every block above it is mapped on its own and unmapped when freed.
Called by the policy's builder (megatron_policy.py) when `host_mmap_threshold_mb` is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt's parameter number for the mmap threshold (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
#: The largest threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit hosts).
MAX_THRESHOLD = 32 * 2**20


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at `nbytes`; False where the C library is not glibc."""
    if not 0 < nbytes <= MAX_THRESHOLD:
        raise ValueError(f"mmap threshold {nbytes} bytes: expected 1 to {MAX_THRESHOLD}")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
    except (OSError, AttributeError):
        log.info("not glibc: the host allocator's mmap threshold is left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) refused")
    return True
