"""Where tensors start when they are laid out back to back in one buffer.

Both ends of a weight update lay tensors out this way: the engine's parameters
(engine/flat_weights.py) and a trainer's staging buffer (trainer/weights/bucket_shares.py).
Laid out by the same rule and in the same order, the two buffers match byte for byte, padding
included, so the engine copies a whole bucket as one span.

Every tensor starts on a multiple of ALIGN_BYTES: a separate CUDA allocation starts on 512,
and cuBLAS picks its kernels by how its operands are aligned (up to 256 bytes, as torch tells
it), so a weight inside a buffer is as aligned as one of its own would be.
"""

from __future__ import annotations

ALIGN_BYTES = 256


def aligned(offset: int, element_size: int) -> int:
    """`offset` (in elements of `element_size` bytes) rounded up to the next ALIGN_BYTES."""
    step = max(1, ALIGN_BYTES // element_size)
    return -(-offset // step) * step
