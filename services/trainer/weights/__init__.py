"""Weights in and out of the trainer: the map between megatron and Hugging Face names (dense and
MLA), loading a Hugging Face checkpoint, export back to safetensors, the trainer's own checkpoints,
the bucketed broadcast that syncs new weights to the engines, and its colocated form (CUDA IPC
handles, weight_ipc.py)."""
