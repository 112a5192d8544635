"""Attention kernels of the trainer's megatron model: the fused SDPA/varlen core attention,
multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA), rotary embeddings,
shared-prefix packing and context parallelism (each rank's slice of a row and the ring that
gathers its keys)."""
