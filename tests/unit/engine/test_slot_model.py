"""The slots forward against the transformers forward of the same weights: prefill after a
cached prefix, then decode steps of rows at different lengths, for each supported family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from services.common.errors import Unavailable
from services.engine.decode_graphs import batch_buckets, width_bucket
from services.engine.slot_kv import SlotKV
from services.engine.slot_model import PrefillRow, SlotModel, unsupported_reason

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build(config_class: Any, **extra: Any) -> Any:
    torch.manual_seed(0)
    config = config_class(**SHAPE, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():  # biases are zero at init: make them matter
        param.data.normal_(0, 0.2)
    return model


FAMILIES = {
    "llama": lambda: build(LlamaConfig),
    "qwen2": lambda: build(Qwen2Config),  # q/k/v biases
    "qwen3": lambda: build(Qwen3Config, head_dim=16),  # q/k norms
    "llama3-rope": lambda: build(LlamaConfig, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def slots_for(model: Any, num_slots: int = 4, slot_len: int = 64) -> SlotKV:
    return SlotKV(num_layers=2, num_slots=num_slots, slot_len=slot_len, kv_heads=2,
                  head_dim=model.model.layers[0].self_attn.head_dim, dtype=torch.float32,
                  device=torch.device("cpu"))


def reference_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_match_transformers(family: str) -> None:
    model = FAMILIES[family]()
    assert unsupported_reason(model) is None
    kv = slots_for(model)
    slot_model = SlotModel(model, kv)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    slots = [2, 0, 3]  # not in row order: rows find their slot by index
    # Row 1 arrives with its first 9 tokens cached: only the rest is computed.
    cached = reference_kv(model, prompts[1][:9])
    kv.write(slots[1], cached)
    starts = [0, 9, 0]
    # All three in one right-padded forward; row 2 asks only for its last token's logits.
    rows = [PrefillRow(slot, prompt[start:], start, all_logits=i < 2)
            for i, (prompt, slot, start) in enumerate(zip(prompts, slots, starts, strict=True))]
    outs = slot_model.prefill(rows)
    for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
        want = reference_logits(model, prompt)[start:] if i < 2 else reference_logits(
            model, prompt)[-1:]
        torch.testing.assert_close(outs[i], want, rtol=1e-4, atol=1e-4)
    sequences = [list(p) for p in prompts]
    lengths = [len(p) for p in prompts]
    for _ in range(4):
        nexts = [int(torch.randint(0, 97, (), generator=gen)) for _ in sequences]
        with torch.inference_mode():
            logits = slot_model.decode(torch.tensor(nexts), torch.tensor(lengths),
                                       torch.tensor(slots), width_bucket(max(lengths) + 1, 64))
        for row, token in enumerate(nexts):
            sequences[row].append(token)
            want = reference_logits(model, sequences[row])[-1]
            torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)
        lengths = [n + 1 for n in lengths]


def reference_kv(model: Any, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_padding_rows_write_only_the_sink() -> None:
    model = FAMILIES["qwen2"]()
    kv = slots_for(model, num_slots=2, slot_len=32)
    slot_model = SlotModel(model, kv)
    slot_model.prefill([PrefillRow(0, [1, 2, 3], 0, all_logits=False)])
    before = [k.clone() for k in kv.keys]
    with torch.inference_mode():
        slot_model.decode(torch.tensor([4, 0, 0]), torch.tensor([3, 0, 0]),
                          torch.tensor([0, kv.sink, kv.sink]), 32)
    for old, new in zip(before, kv.keys, strict=True):
        assert torch.equal(old[1], new[1])  # the free slot is untouched
        assert torch.equal(old[0, :, :3], new[0, :, :3]) and not torch.equal(old[0], new[0])


def test_slots_are_handed_out_once() -> None:
    kv = SlotKV(num_layers=1, num_slots=2, slot_len=8, kv_heads=1, head_dim=4,
                dtype=torch.float32, device=torch.device("cpu"))
    taken = {kv.allocate(), kv.allocate()}
    assert taken == {0, 1}
    with pytest.raises(Unavailable, match="all 2 KV slots"):
        kv.allocate()
    kv.release(1)
    with pytest.raises(ValueError, match="not allocated"):
        kv.release(1)
    assert kv.allocate() == 1


def test_unsupported_models_are_named() -> None:
    model = build(Qwen2Config, use_sliding_window=True, sliding_window=16)
    assert unsupported_reason(model) == "sliding-window attention"
    dynamic = build(LlamaConfig, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                  "factor": 2.0})
    assert "dynamic" in (unsupported_reason(dynamic) or "")


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100)[-3:] == [80, 96, 100]
    assert batch_buckets(1) == [1]
    widths = [width_bucket(n, 4096) for n in (1, 129, 193, 257, 513, 769, 5000)]
    assert widths == [128, 192, 256, 384, 768, 1024, 4096]
    assert width_bucket(700, 600) == 600
