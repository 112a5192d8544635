"""Uneven pipeline stages (pipeline_layout.py): the config field is checked against the
pipeline size and the model, reaches megatron's TransformerConfig as a layer layout, and
the converters find each layer's stage from a built model's config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.common.errors import ConfigError
from services.deployment import validate_config
from services.trainer.model.model import ModelShape, transformer_config
from services.trainer.parallel.pipeline_layout import (
    megatron_layout,
    owner_stage,
    split_layers,
    stage_layer_counts,
)


def _shape(num_layers: int) -> ModelShape:
    return ModelShape(vocab_size=64, hidden_size=32, num_layers=num_layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, ffn_hidden_size=64, norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=128,
                      tie_word_embeddings=False, qkv_bias=False, qk_norm=False)  # fmt: skip


def test_reference_split_reaches_megatron_and_maps_layers_to_stages() -> None:
    counts = [18, 20, 20, 20]
    config = transformer_config(_shape(78), pp=4, num_layers_per_stage=counts)
    assert stage_layer_counts(SimpleNamespace(config=config)) == counts
    assert [owner_stage(i, counts) for i in (0, 17, 18, 37, 38, 58, 77)] == [0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="layer 78"):
        owner_stage(78, counts)


def test_even_split_is_megatrons_default() -> None:
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert megatron_layout([2, 2, 2, 2]) is None
    config = transformer_config(_shape(8), pp=4)
    assert config.pipeline_model_parallel_layout is None
    assert stage_layer_counts(SimpleNamespace(config=config)) == [2, 2, 2, 2]
    assert megatron_layout([1, 2]) == [["embedding", "decoder"], ["decoder", "decoder", "loss"]]


def test_counts_that_miss_the_model_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"num_layers_per_stage = \[1, 1\].*3 layers"):
        transformer_config(_shape(3), pp=2, num_layers_per_stage=[1, 1])
    with pytest.raises(ConfigError, match=r"num_layers_per_stage = \[1, 2\] has 2 entries"):
        transformer_config(_shape(3), pp=3, num_layers_per_stage=[1, 2])
    with pytest.raises(ConfigError, match="pipeline_parallel=2 must divide the 3 layers"):
        transformer_config(_shape(3), pp=2)


def _deployment(parallel: dict[str, object]) -> dict[str, object]:
    return {"run": {"admin_token": "0123456789"}, "trainer": {"parallel": parallel}}


def test_config_field_needs_one_positive_count_per_stage() -> None:
    ok = {"pipeline_parallel": 2, "num_layers_per_stage": [1, 2]}
    assert validate_config(_deployment(ok)).trainer.parallel.num_layers_per_stage == [1, 2]
    for stages in ([1, 2, 3], [3, 0]):
        parallel = {"pipeline_parallel": 2, "num_layers_per_stage": stages}
        with pytest.raises(ConfigError, match=r"trainer\.parallel.*num_layers_per_stage"):
            validate_config(_deployment(parallel))
