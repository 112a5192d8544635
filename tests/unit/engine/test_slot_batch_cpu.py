"""The slots backend on CPU: its eager decode (consecutive slots read as one view, rows taken in
slot order; other layouts gathered) computes transformers' logits in float32 and within
bfloat16's own rounding, and `auto` picks it on CPU for the models it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from services.common.errors import ConfigError
from services.common.tiny_model import create_tiny_model
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.slot_batch import SlotBatch
from services.engine.slot_kv import SlotKV
from services.engine.slot_model import choose_decode_backend

CPU = torch.device("cpu")
PROMPT_LENGTHS = (5, 17, 30, 11)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def last_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def run_layout(runner: ModelRunner, layout: str, steps: int = 4
               ) -> tuple[list[list[int]], list[torch.Tensor], list[Any]]:
    """Prefill four prompts into slots 0-3 and decode `steps` tokens with the rows laid out as
    `layout` says; returns the sequences, each step's logits and the slots each step read."""
    batch = SlotBatch(runner, num_slots=6, slot_len=64, cuda_graph=False)
    reads: list[Any] = []
    decode = batch.model.decode

    def spy(*args: Any) -> torch.Tensor:
        reads.append(args[4])
        return decode(*args)

    batch.model.decode = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    pending = [row for _, row in batch.prefill([(p, None, False) for p in prompts])]
    order = {"in order": [0, 1, 2, 3], "shuffled": [2, 0, 3, 1], "hole": [3, 0, 2]}[layout]
    if layout == "hole":  # slot 1 leaves: the rest are not consecutive
        batch.discard(pending[1])
    batch.add_rows([pending[i] for i in order])
    sequences = [list(prompts[i]) for i in order]
    outs = []
    for _ in range(steps):
        nexts = [int(torch.randint(0, 200, (), generator=gen)) for _ in sequences]
        outs.append(batch.decode(nexts).float())
        for sequence, token in zip(sequences, nexts, strict=True):
            sequence.append(token)
    return sequences, outs, reads


@pytest.mark.parametrize("layout", ["in order", "shuffled", "hole"])
def test_eager_decode_matches_transformers(model_path: Path, layout: str) -> None:
    runner = ModelRunner(EngineConfig(model_path=str(model_path), decode_backend="slots"))
    sequences, outs, reads = run_layout(runner, layout)
    if layout == "hole":
        assert all(read is None for read in reads)  # gathered by index
    else:
        assert reads[0] == slice(0, 4)  # one view of slots 0-3
    for step, logits in enumerate(outs):
        for row, sequence in enumerate(sequences):
            cut = len(sequence) - len(outs) + step + 1
            torch.testing.assert_close(logits[row], last_logits(runner.model, sequence[:cut]),
                                       rtol=1e-4, atol=1e-4)


def test_bfloat16_decode_is_within_bfloat16_rounding(model_path: Path) -> None:
    """In bf16 the slots forward is as far from the float32 logits as transformers' own bf16
    forward is (their attention kernels round differently, neither is exact)."""
    runner = ModelRunner(EngineConfig(model_path=str(model_path), decode_backend="slots",
                                      dtype="bfloat16"))
    exact = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    sequences, outs, _ = run_layout(runner, "shuffled", steps=2)
    for step, logits in enumerate(outs):
        for row, sequence in enumerate(sequences):
            tokens = sequence[: len(sequence) - len(outs) + step + 1]
            want = last_logits(exact, tokens)
            ours = (logits[row] - want).abs().max().item()
            theirs = (last_logits(runner.model, tokens) - want).abs().max().item()
            assert ours <= 2 * theirs + 0.05, (ours, theirs)
            assert logits[row].argmax() == last_logits(runner.model, tokens).argmax()


def test_auto_picks_slots_on_cpu_for_models_it_runs(model_path: Path) -> None:
    assert ModelRunner(EngineConfig(model_path=str(model_path))).decode_backend == "slots"
    llama = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    assert choose_decode_backend("auto", llama, CPU) == "slots"
    assert choose_decode_backend("transformers", llama, CPU) == "transformers"
    windowed = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
        sliding_window=16))
    assert choose_decode_backend("auto", windowed, CPU) == "transformers"
    with pytest.raises(ConfigError, match="sliding-window"):
        choose_decode_backend("slots", windowed, CPU)


def test_cpu_slots_start_zeroed_and_go_lowest_first() -> None:
    kv = SlotKV(num_layers=2, num_slots=4, slot_len=16, kv_heads=2, head_dim=8,
                dtype=torch.bfloat16, device=CPU)
    assert all(not t.any() for t in (*kv.keys, *kv.values))
    assert kv.keys[0].shape == (5, 2, 16, 8) and kv.keys[0].dtype == torch.bfloat16
    assert [kv.allocate() for _ in range(3)] == [0, 1, 2]
    kv.release(1)
    kv.release(0)
    assert kv.allocate() == 0 and kv.allocate() == 1 and kv.allocate() == 3
