"""The optimizer: Adam with fp32 master weights streamed bucket by bucket from host or disk, its
shard across data-parallel ranks, the global gradient norm and clipping, the contiguous gradient
buffer, and pinned host allocation."""
