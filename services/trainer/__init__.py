"""The trainer: megatron-core policy training from the sample stream."""
