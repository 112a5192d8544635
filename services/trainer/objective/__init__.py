"""What the trainer optimizes and reports: token log-probs (chunked, fused with the output layer,
Triton kernels on GPU), the clipped policy-gradient loss with importance-sampling correction, and
the step's statistics."""
