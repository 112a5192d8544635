"""A one-rank trainer checkpoint exported as a Hugging Face folder holds the trained weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.engine_process import tiny_model_path
from services.testing.trainer_ranks import run_ranks


def make_checkpoint(rank: int, world_size: int, master_port: int, base: str,
                    checkpoint: str) -> dict[str, float]:
    """A checkpoint whose weights differ from the base model's; their HF-named sums."""
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import build_model
    from services.trainer.model.policy import MODEL_FILE
    from services.trainer.weights.convert import iter_hf_tensors

    config = TrainerConfig.model_validate({"model": {"hf_path": base, "dtype": "float32"}})
    model, shape, _, _ = build_model(config)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (i + 1))
    Path(checkpoint).mkdir(parents=True)
    torch.save(model.state_dict(), Path(checkpoint) / MODEL_FILE)
    return {name: float(t.double().sum()) for name, t in iter_hf_tensors(model, shape)}


def export(rank: int, world_size: int, master_port: int, base: str, checkpoint: str,
           out: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from services.trainer.weights.export import export_checkpoint

    folder = export_checkpoint(Path(checkpoint), Path(base), Path(out))
    tensors = load_file(str(folder / "model.safetensors"))
    return {"sums": {name: float(t.double().sum()) for name, t in tensors.items()},
            "files": sorted(p.name for p in folder.iterdir())}


@pytest.mark.slow
def test_an_exported_checkpoint_holds_the_trained_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = str(tiny_model_path())
    checkpoint = str(tmp_path / "step-3")
    (trained,) = run_ranks(Path(__file__), "make_checkpoint", 1,
                           {"base": base, "checkpoint": checkpoint})
    (exported,) = run_ranks(Path(__file__), "export", 1,
                            {"base": base, "checkpoint": checkpoint, "out": str(tmp_path / "hf")})
    assert exported["sums"].keys() == trained.keys()
    for name, total in trained.items():
        assert exported["sums"][name] == pytest.approx(total, rel=1e-6, abs=1e-6), name
    original = load_file(str(next(Path(base).glob("*.safetensors"))))
    changed = [n for n, t in original.items() if n in trained
               and abs(float(t.double().sum()) - trained[n]) > 1e-3]
    assert changed, "the checkpoint's weights must differ from the base model's"
    assert {"config.json", "model.safetensors"} <= set(exported["files"])
    assert any(name.startswith("tokenizer") for name in exported["files"])
