"""The warm start's data side: the trajectories file, the epoch order, the micro-batches."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from services.common.config import validate_section
from services.common.errors import ConfigError, InvalidRequest
from services.trainer.data.batch import sequence_micro_batches
from services.trainer.sft import SftConfig, batches, load_sequences


def test_the_trajectories_file_is_read_and_bad_lines_are_named(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"task": "a", "ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n\n")
    assert load_sequences(good) == [([1, 2, 3], [0, 1, 1])]
    for line, problem in ((json.dumps({"ids": [1, 2]}), "KeyError"),
                          (json.dumps({"ids": [1, 2], "loss_mask": [1]}), "one entry per id"),
                          (json.dumps({"ids": [1], "loss_mask": [0]}), "at least one 1"),
                          ("not json", "JSONDecodeError")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"ids": [5], "loss_mask": [1]}) + "\n" + line + "\n")
        with pytest.raises(ConfigError, match=rf"bad.jsonl:2: .*{problem}"):
            load_sequences(bad)
    with pytest.raises(ConfigError, match="no such trajectories file"):
        load_sequences(tmp_path / "missing.jsonl")


def test_each_epoch_sees_every_sequence_once_in_a_fresh_order() -> None:
    order = batches(5, 2, seed=3)
    steps = [next(order) for _ in range(10)]  # 20 picks: 4 epochs of 5
    assert all(len(step) == 2 for step in steps)
    flat = [i for step in steps for i in step]
    epochs = [flat[i:i + 5] for i in range(0, 20, 5)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    assert Counter(flat) == Counter({i: 4 for i in range(5)})
    assert [next(batches(5, 2, seed=3)) for _ in range(2)] == [steps[0]] * 2


def test_sequences_become_padded_micro_batches_within_the_token_budget() -> None:
    sequences = [([1] * 6, [0, 0, 1, 1, 1, 0]), ([2] * 3, [0, 1, 1]), ([3] * 5, [0] * 4 + [1])]
    micro = sequence_micro_batches(sequences, max_tokens_per_microbatch=12, pad_id=9)
    assert [mb.lengths for mb in micro] == [[6, 5], [3]]
    assert micro[0].input_ids[1].tolist() == [3] * 5 + [9]
    assert micro[0].loss_mask[1].tolist() == [0, 0, 0, 0, 1, 0]
    assert sum(mb.num_loss_tokens for mb in micro) == 6
    with pytest.raises(InvalidRequest, match="sequence 0"):
        sequence_micro_batches([([1, 2], [1])], 8)


def test_settings_out_of_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_steps"):
        validate_section(SftConfig, {"hf_path": "m", "num_steps": 0}, "riptide sft")
    with pytest.raises(ConfigError, match="lr"):
        validate_section(SftConfig, {"hf_path": "m", "lr": -1.0}, "riptide sft")


def test_riptide_sft_refuses_bad_input_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    base = ["sft", "--model", str(tmp_path), "--out", str(tmp_path / "out")]
    assert main([*base, "--tasks", str(tmp_path), "--steps", "0"]) == 2
    assert "num_steps" in capsys.readouterr().err
    assert main([*base, "--tasks", str(tmp_path / "none")]) == 2
    assert "not a directory of tasks" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
