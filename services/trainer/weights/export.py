"""A trainer checkpoint as a Hugging Face model folder, for engines and `riptide eval`.

The checkpoint's weights (`step-<n>/model.pt`, a one-rank trainer's megatron state) are loaded
into a megatron model built from the base model's config, converted to Hugging Face names
(the same conversion the weight sync uses) and written as `model.safetensors` beside a copy of
the base folder's config and tokenizer files. Checkpoints of multi-rank trainers are refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.trainer.model.policy import MODEL_FILE

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def export_checkpoint(checkpoint: Path, base_hf_path: Path, out: Path,
                      dtype: str = "float32") -> Path:
    """Write `checkpoint`'s weights as a Hugging Face folder `out` (made atomically)."""
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import build_model

    weights = checkpoint / MODEL_FILE
    if not weights.is_file():
        raise ConfigError(f"{checkpoint}: no {MODEL_FILE}; expected a one-rank trainer "
                          "checkpoint (step-<n>) or a Hugging Face model folder")
    config = TrainerConfig.model_validate({"model": {"hf_path": str(base_hf_path),
                                                     "dtype": dtype}})
    model, shape, _, _ = build_model(config)
    model.load_state_dict(torch.load(weights, weights_only=True))
    return write_hf_folder(model, shape, base_hf_path, out)


def write_hf_folder(model: Any, shape: Any, base_hf_path: Path, out: Path) -> Path:
    """Write a one-rank megatron `model` (of `shape`, a model.ModelShape) as a Hugging Face
    folder `out` in fp32, with the base folder's config and tokenizer (made atomically)."""
    import torch
    from safetensors.torch import save_file

    from services.trainer.weights.convert import iter_hf_tensors

    tensors = {name: t.detach().to(torch.float32).contiguous().clone()
               for name, t in iter_hf_tensors(model, shape)}
    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in base_hf_path.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) \
                and "index.json" not in item.name:
            shutil.copy2(item, staging / item.name)
    save_file(tensors, str(staging / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
