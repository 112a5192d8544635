"""The trainer: megatron-core policy training from the sample stream.

The top level holds the service and what composes the rooms below it (the loop, the steps, the
policy builder, the ranks, supervised warm start, the config); the rooms, from high to low, are
`weights/`, `model/`, `data/`, `objective/`, `attention/`, `optim/` and `parallel/` (the
import contract in pyproject.toml keeps that order)."""
