"""Range and shape checks of `Rollout.UpdateWeights` messages, before any engine is touched.

A Begin is checked before the update lock is taken or an engine paused; a Bucket before its
metadata reaches an engine, so a bad value is INVALID_ARGUMENT with a precise message (naming
at most a short prefix of the bad input) and never a half-applied update. Called by
weight_update.py.
"""

from __future__ import annotations

import math

from services._proto.riptide.v1 import rollout_pb2 as pb
from services.common.errors import quote
from services.common.grpc_requests import require

#: Weight dtypes an engine can receive: torch dtype names without the `torch.` prefix.
WEIGHT_DTYPES = frozenset({
    "bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool"})
BACKENDS = frozenset({"nccl", "gloo"})
MAX_NAME_CHARS = 512
MAX_TENSORS_PER_BUCKET = 100_000
MAX_DIMS = 8
MAX_ELEMENTS = 2**40  # a trillion elements: far beyond any one weight


def check_begin(begin: pb.WeightUpdateBegin) -> None:
    """The Begin's version, rendezvous address and backend are usable (colocated: no
    rendezvous)."""
    require(begin.weight_version >= 0,
            f"begin.weight_version: must be 0 or more, got {begin.weight_version}")
    if begin.colocated:
        return
    require(0 < len(begin.master_address) <= 255 and begin.master_address.isprintable()
            and " " not in begin.master_address,
            f"begin.master_address: a host name or address is needed, got "
            f"{quote(begin.master_address, 40)}")
    require(0 < begin.master_port <= 65535,
            f"begin.master_port: must be in [1, 65535], got {begin.master_port}")
    require(0 < len(begin.group_name) <= 128,
            f"begin.group_name: 1 to 128 characters, got {quote(begin.group_name, 40)}")
    require(begin.backend in BACKENDS,
            f"begin.backend: one of {', '.join(sorted(BACKENDS))}, got "
            f"{quote(begin.backend, 40)}")


def check_bucket(bucket: pb.WeightBucket, expected_index: int, colocated: bool = False) -> None:
    """The bucket comes in order and each tensor has a name, a known dtype and a shape; a
    colocated bucket carries its payload, a broadcast one none."""
    where = f"bucket {expected_index}"
    require(bool(bucket.serialized_named_tensors) == colocated,
            f"{where}: serialized_named_tensors is "
            + ("needed in a colocated update" if colocated else "only for colocated updates"))
    require(bucket.bucket_index == expected_index,
            f"bucket.bucket_index: buckets come in order from 0, expected {expected_index}, "
            f"got {bucket.bucket_index}")
    require(0 < len(bucket.tensors) <= MAX_TENSORS_PER_BUCKET,
            f"{where}: 1 to {MAX_TENSORS_PER_BUCKET} tensors, got {len(bucket.tensors)}")
    seen: set[str] = set()
    for i, tensor in enumerate(bucket.tensors):
        at = f"{where} tensors[{i}]"
        require(0 < len(tensor.name) <= MAX_NAME_CHARS,
                f"{at}.name: 1 to {MAX_NAME_CHARS} characters, got {quote(tensor.name, 40)}")
        require(tensor.name not in seen,
                f"{at}.name: {quote(tensor.name, 80)} appears twice in the bucket")
        seen.add(tensor.name)
        require(tensor.dtype in WEIGHT_DTYPES,
                f"{at}.dtype: one of {', '.join(sorted(WEIGHT_DTYPES))}, got "
                f"{quote(tensor.dtype, 40)}")
        shape = list(tensor.shape)
        require(len(shape) <= MAX_DIMS and all(d >= 1 for d in shape)
                and math.prod(shape) <= MAX_ELEMENTS,
                f"{at}.shape: at most {MAX_DIMS} dimensions of 1 or more and at most "
                f"{MAX_ELEMENTS} elements, got {quote(shape, 80)}")
