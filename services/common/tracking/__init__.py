"""Export of the run's metrics to TensorBoard and Weights & Biases, from its events stream."""
