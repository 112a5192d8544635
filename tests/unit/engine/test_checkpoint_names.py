"""Checkpoint-named tensors of MoE models (per-expert gate/up/down, Mixtral's w1/w3/w2 under
block_sparse_moe) fill transformers 5's fused expert parameters exactly: loading model B's
safetensors into model A by checkpoint name makes A equal to B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.engine.checkpoint_names import CheckpointNames
from services.testing.hf_models import random_hf_model


def _checkpoint(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder)  # type: ignore[operator]
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "llama"])
def test_checkpoint_names_fill_the_fused_experts(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    target = random_hf_model(arch, num_layers=2)
    torch.manual_seed(1)
    source = random_hf_model(arch, num_layers=2)
    checkpoint = _checkpoint(source, tmp_path)
    if arch != "llama":
        assert any(".experts.0." in name for name in checkpoint)  # per-expert names on disk
    names = CheckpointNames(dict(target.state_dict(keep_vars=True)))
    with torch.no_grad():
        for name, tensor in checkpoint.items():
            view = names.view(name)
            assert view is not None, name
            assert view.shape == tensor.shape, name
            view.copy_(tensor)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_unknown_names_and_experts_resolve_to_none() -> None:
    names = CheckpointNames(dict(random_hf_model("qwen2_moe", num_layers=1).state_dict()))
    assert names.view("model.layers.0.mlp.experts.99.gate_proj.weight") is None
    assert names.view("model.layers.0.mlp.experts.0.gate_proj.bias") is None
    assert names.view("model.layers.7.self_attn.q_proj.weight") is None
