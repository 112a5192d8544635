"""A fixed mmap threshold hands freed blocks back to the OS; glibc's adaptive one keeps them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.trainer.optim.host_malloc import MAX_THRESHOLD, fix_mmap_threshold

# 48 blocks of 4 MiB, written, then all freed but the last (which pins the heap's top): the
# RSS they leave behind, in MiB. First a 20 MiB block is freed, which raises glibc's adaptive
# threshold above 4 MiB, as a training step's first large frees do.
_KEPT_MIB = """
import ctypes, json, sys
from services.trainer.optim.host_malloc import fix_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
fixed = sys.argv[1] == "fixed"
if fixed:
    assert fix_mmap_threshold(2**20)
libc.free(libc.malloc(20 * 2**20))
before = rss_mib()
blocks = [libc.malloc(4 * 2**20) for _ in range(48)]
for block in blocks:
    ctypes.memset(block, 1, 4 * 2**20)
for block in blocks[:-1]:
    libc.free(block)
print(json.dumps(rss_mib() - before))
"""


def _kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _KEPT_MIB, mode], capture_output=True,
                         text=True, check=True).stdout
    return float(json.loads(out))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_fixed_threshold_returns_freed_blocks_the_adaptive_one_keeps() -> None:
    adaptive, fixed = _kept_mib("adaptive"), _kept_mib("fixed")
    assert adaptive > 150, f"glibc kept only {adaptive:.0f} MiB: the test shows nothing here"
    assert fixed < 16, f"{fixed:.0f} MiB of freed blocks kept under a fixed 1 MiB threshold"


def test_thresholds_outside_glibc_range_are_refused() -> None:
    for wrong in (0, MAX_THRESHOLD + 1):
        with pytest.raises(ValueError, match="mmap threshold"):
            fix_mmap_threshold(wrong)
