"""The in-place growing KV layer holds exactly what transformers' concatenating layer holds."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from services.common.tiny_model import create_tiny_model
from services.engine.kv_storage import GrowingLayer, growing_cache


def test_growing_layer_equals_concatenation_across_reallocations() -> None:
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 5, 4, generator=gen)
    layer = GrowingLayer(keys, values, spare=2)
    expected_k, expected_v = keys, values
    for width in (1, 1, 3, 1, 1):  # crosses the spare capacity twice
        new_k = torch.randn(2, 3, width, 4, generator=gen)
        new_v = torch.randn(2, 3, width, 4, generator=gen)
        got_k, got_v = layer.update(new_k, new_v)
        expected_k = torch.cat([expected_k, new_k], dim=2)
        expected_v = torch.cat([expected_v, new_v], dim=2)
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    assert layer.get_seq_length() == expected_k.shape[2]


def test_earlier_views_survive_later_writes() -> None:
    """Rows handed to the prefix cache are views; later decode steps must not change them."""
    keys = torch.randn(1, 1, 3, 2)
    layer = GrowingLayer(keys, keys.clone(), spare=4)
    before = layer.keys.clone()
    view = layer.keys
    layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert torch.equal(view, before)


def test_decode_through_a_growing_cache_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = create_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :6], use_cache=True).past_key_values
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in prefix.layers]
        reference = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layers])
        growing = growing_cache(layers, spare=1)
        for column in range(6, 9):
            step = {"input_ids": ids[:, column : column + 1], "use_cache": True}
            want = model(**step, past_key_values=reference).logits
            got = model(**step, past_key_values=growing).logits
            assert torch.allclose(got, want, atol=1e-6)
