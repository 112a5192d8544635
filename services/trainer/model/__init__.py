"""The policy model: how the megatron GPT (dense, MLA, MoE) is shaped and built from a Hugging Face
config, its layer specs (SwiGLU MLP, compiled layers, routing replay in the MoE router), and the
`Policy` interface the training step drives. Building a whole policy (model, optimizer, weights)
is `services/trainer/megatron_policy.py`, one level up."""
