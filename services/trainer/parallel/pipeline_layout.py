"""Which decoder layers each pipeline stage holds.

By default the layers split evenly over the stages; `parallel.num_layers_per_stage` gives
each stage its own count (the reference layout: 78 layers as 18-20-20-20, the first stage
also holding the embedding). Uneven splits reach megatron as its
`pipeline_model_parallel_layout` (embedding and decoders on the first stage, decoders and the
loss on the last), which places any list of counts; `stage_layer_counts` reads the split back
from a built model, so the converters (convert.py) find each layer's stage.
Used by model.py and model_mla.py (the TransformerConfig) and convert.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.errors import ConfigError

FIELD = "trainer.parallel.num_layers_per_stage"


def split_layers(
    num_layers: int, pipeline_parallel: int, num_layers_per_stage: Sequence[int] | None = None
) -> list[int]:
    """Each stage's layer count: `num_layers_per_stage` checked against the model, or even."""
    if num_layers_per_stage is None:
        if num_layers % pipeline_parallel:
            raise ConfigError(
                f"pipeline_parallel={pipeline_parallel} must divide the {num_layers} layers;"
                f" or set {FIELD} to each stage's layer count"
            )
        return [num_layers // pipeline_parallel] * pipeline_parallel
    counts = list(num_layers_per_stage)
    if len(counts) != pipeline_parallel:
        raise ConfigError(f"{FIELD} = {counts} has {len(counts)} entries but pipeline_parallel"
                          f" = {pipeline_parallel}; give one layer count per stage")
    if sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(f"{FIELD} = {counts} must be positive counts summing to the model's"
                          f" {num_layers} layers (they sum to {sum(counts)})")
    return counts


def megatron_layout(counts: Sequence[int]) -> list[list[str]] | None:
    """megatron's `pipeline_model_parallel_layout` for uneven `counts` (None when even)."""
    if len(set(counts)) <= 1:
        return None
    stages = [["decoder"] * n for n in counts]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


def stage_layer_counts(model: Any) -> list[int]:
    """The layer counts of the stages of a built megatron model (read from its config)."""
    from megatron.core.transformer.enums import LayerType

    config = model.config
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return [config.num_layers // config.pipeline_model_parallel_size] * (
            config.pipeline_model_parallel_size
        )
    return [sum(chunk.count(LayerType.decoder) for chunk in stage) for stage in layout.layout]


def owner_stage(layer: int, counts: Sequence[int]) -> int:
    """The pipeline stage that holds decoder layer `layer` (0-based)."""
    end = 0
    for stage, n in enumerate(counts):
        end += n
        if layer < end:
            return stage
    raise ValueError(f"layer {layer} is beyond the {end} layers of the stages {list(counts)}")
