"""Short prefills padded to a (rows, tokens, width) bucket, as the CUDA graphs replay them, run
here eagerly: the same logits and the same keys and values in the rows' slots as the eager
prefill, padding only in the sink, and what does not fit a bucket left to the eager path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from services.common.tiny_model import create_tiny_model
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.prefill_graphs import PrefillGraphs
from services.engine.slot_batch import SlotBatch
from services.engine.slot_model import PrefillRow, SlotModel
from tests.unit.engine.test_slot_model import build, slots_for


def _rows(gen: torch.Generator) -> list[PrefillRow]:
    """Three rows of different lengths over cached prefixes, in slots out of row order."""
    return [PrefillRow(2, torch.randint(0, 97, (7,), generator=gen).tolist(), 20, False),
            PrefillRow(0, torch.randint(0, 97, (13,), generator=gen).tolist(), 3, False),
            PrefillRow(3, torch.randint(0, 97, (1,), generator=gen).tolist(), 41, False)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_prefill_equals_the_eager_one_and_pads_only_the_sink(family: str) -> None:
    model = build(LlamaConfig) if family == "llama" else build(Qwen3Config, head_dim=16)
    kv = slots_for(model, num_slots=5, slot_len=64)
    slot_model = SlotModel(model, kv)
    gen = torch.Generator().manual_seed(3)
    for layer in range(2):  # earlier tokens in every slot, the sink included
        kv.keys[layer].normal_(generator=gen)
        kv.values[layer].normal_(generator=gen)
    before = [(k.clone(), v.clone()) for k, v in zip(kv.keys, kv.values, strict=True)]
    rows = _rows(gen)
    graphs = PrefillGraphs(slot_model, use_graphs=False)
    key = graphs.key(rows)
    assert key == (4, 16, 128 if kv.slot_len >= 128 else 64)  # rows 3 -> 4, tokens 13 -> 16
    padded = graphs.prefill(rows, key)
    after_padded = [(k.clone(), v.clone()) for k, v in zip(kv.keys, kv.values, strict=True)]
    for layer, (k, v) in enumerate(before):  # the same start for the eager run
        kv.keys[layer].copy_(k)
        kv.values[layer].copy_(v)
    eager = slot_model.prefill(rows)
    for mine, theirs in zip(padded, eager, strict=True):
        assert mine.shape == theirs.shape == (1, 97)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    real = [0, 1, 2, 3, 4]  # every slot but the sink: equal to the eager prefill's writes
    for layer in range(2):
        torch.testing.assert_close(after_padded[layer][0][real], kv.keys[layer][real])
        torch.testing.assert_close(after_padded[layer][1][real], kv.values[layer][real])
    # slots 1 and 4 hold no row: untouched by the padded rows
    for layer in range(2):
        for slot in (1, 4):
            assert torch.equal(after_padded[layer][0][slot], before[layer][0][slot])


def test_what_does_not_fit_a_bucket_is_left_to_the_eager_path() -> None:
    model = build(LlamaConfig)
    slot_model = SlotModel(model, slots_for(model, num_slots=20, slot_len=300))
    graphs = PrefillGraphs(slot_model, use_graphs=False)
    short = PrefillRow(0, [1] * 10, 5, False)
    assert graphs.key([short]) == (1, 16, 128)
    assert graphs.key([PrefillRow(0, [1] * 10, 5, True)]) is None  # every position's logits
    assert graphs.key([PrefillRow(0, [1] * 257, 0, False)]) is None  # longer than 256
    assert graphs.key([short] * 17) is None  # more rows than the largest bucket
    assert graphs.key([PrefillRow(0, [1] * 10, 190, False)]) == (1, 16, 256)
    graphs.failed.add((1, 16, 128))  # a bucket whose capture failed runs eagerly after
    assert graphs.key([short]) is None


def test_the_running_batch_prefills_short_rows_through_the_buckets(tmp_path: Path) -> None:
    runner = ModelRunner(EngineConfig(model_path=str(create_tiny_model(tmp_path / "m")),
                                      dtype="float32", decode_backend="slots"))
    gen = torch.Generator().manual_seed(5)
    short = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (9, 20)]
    long = torch.randint(1, 200, (300,), generator=gen).tolist()  # pieces too long for a bucket
    for jobs in ([short[0], long, short[1]], short):  # the long one runs eagerly
        batch = SlotBatch(runner, num_slots=4, slot_len=512, cuda_graph=False)
        graphs = batch.prefill_graphs = PrefillGraphs(batch.model, use_graphs=False)
        replays: list[tuple[int, int, int]] = []
        prefill = graphs.prefill
        graphs.prefill = (  # type: ignore[method-assign]
            lambda rows, key, seen=replays, run=prefill: seen.append(key) or run(rows, key))
        results = batch.prefill([(tokens, None, False) for tokens in jobs])
        assert replays == [(2, 32, 128)]  # the two short rows together
        for (logits, _), tokens in zip(results, jobs, strict=True):
            with torch.inference_mode():
                reference = runner.model(torch.tensor([tokens])).logits[0, -1:]
            torch.testing.assert_close(logits, reference.to(logits.dtype), rtol=1e-4, atol=1e-4)
