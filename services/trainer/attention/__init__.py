"""Attention kernels of the trainer: MLA, DSA sparse attention, context parallelism."""
