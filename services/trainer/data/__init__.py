"""Samples into batches: reading groups from the Redis stream, packing them into micro-batches with
their advantages, and dealing micro-batches to data-parallel ranks in lockstep."""
