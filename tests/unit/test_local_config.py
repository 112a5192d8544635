"""The local stack's config: overrides merge at every depth; temperatures agree across services."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main as cli_main
from services.common.config import deep_merge, override_tree
from services.common.errors import ConfigError
from services.deployment import validate_config
from services.local_stack import local_config


def test_deep_merge_keeps_siblings_at_every_depth() -> None:
    base = {"a": {"b": {"c": 1, "d": 2}, "e": 3}, "f": 4}
    merged = deep_merge(base, {"a": {"b": {"c": 10}}, "g": 5})
    assert merged == {"a": {"b": {"c": 10, "d": 2}, "e": 3}, "f": 4, "g": 5}
    assert base["a"]["b"]["c"] == 1, "the base must not be modified"


def test_deep_merge_rejects_a_table_over_a_value_and_the_reverse() -> None:
    with pytest.raises(ConfigError, match=r"override a\.b: the config holds a value"):
        deep_merge({"a": {"b": 1}}, {"a": {"b": {"c": 2}}})
    with pytest.raises(ConfigError, match=r"override a: the config holds a table"):
        deep_merge({"a": {"b": 1}}, {"a": 3})


def test_up_set_overrides_become_nested_tables(tmp_path: Path) -> None:
    tree = override_tree(["sandbox.agent.harness=mini_swe_agent", "sandbox.agent.max_turns=5",
                          "trainer.optimizer.lr=1e-5"])
    assert tree == {"sandbox": {"agent": {"harness": "mini_swe_agent", "max_turns": 5}},
                    "trainer": {"optimizer": {"lr": 1e-5}}}
    config = local_config(tmp_path, tree)
    assert config.sandbox.agent.harness == "mini_swe_agent"
    assert config.sandbox.agent.max_turns == 5 and config.sandbox.agent.max_new_tokens == 48
    assert config.sandbox.gateway_enabled  # a harness needs the gateway
    with pytest.raises(ConfigError, match="expected section.key=value"):
        override_tree(["sandbox.agent.harness"])


def test_up_set_with_a_given_config_says_to_edit_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["up", "--dir", str(tmp_path), "--config", str(tmp_path / "mine.toml"),
                     "--set", "sandbox.agent.max_turns=5"])
    assert code == 2 and "with --config, edit that file" in capsys.readouterr().err
    assert not (tmp_path / "config.toml").exists()  # refused before anything was written


def test_nested_overrides_keep_the_local_settings(tmp_path: Path) -> None:
    config = local_config(tmp_path, {
        "trainer": {"model": {"hf_path": "/elsewhere"}, "weight_sync": {"bucket_mb": 4.0}},
        "rollout": {"scheduler": {"n_samples_per_prompt": 2}}})
    assert config.trainer.model.hf_path == "/elsewhere"
    assert config.trainer.model.dtype == "float32"
    assert config.trainer.weight_sync.bucket_mb == 4.0
    assert config.trainer.weight_sync.rollout_address == config.rollout.grpc_address
    assert config.rollout.scheduler.n_samples_per_prompt == 2
    assert config.rollout.scheduler.max_concurrent_samples == 8


def test_the_trainer_follows_the_rollout_temperature(tmp_path: Path) -> None:
    assert local_config(tmp_path).trainer.sampling_temperature == 1.0
    warm = local_config(tmp_path, {"rollout": {"scheduler": {"temperature": 0.8}}})
    assert warm.trainer.sampling_temperature == 0.8
    greedy = local_config(tmp_path, {"rollout": {"scheduler": {"temperature": 0.0}}})
    assert greedy.trainer.sampling_temperature == 1.0


def test_a_temperature_mismatch_is_refused_naming_both_keys() -> None:
    data = {"run": {"name": "t", "admin_token": "x" * 24},
            "rollout": {"scheduler": {"temperature": 0.8}},
            "trainer": {"sampling_temperature": 1.0}}
    with pytest.raises(ConfigError, match=r"trainer.sampling_temperature \(1\) differs from "
                                          r"rollout.scheduler.temperature \(0.8\)"):
        validate_config(data, "deploy.toml")
    data["trainer"]["sampling_temperature"] = 0.8
    assert validate_config(data).trainer.sampling_temperature == 0.8
    del data["trainer"]["sampling_temperature"]  # left out, it follows the rollout's
    assert validate_config(data).trainer.sampling_temperature == 0.8


def test_zero_variance_groups_are_dropped_by_default() -> None:
    config = validate_config({"run": {"name": "t", "admin_token": "x" * 24}})
    assert config.rollout.scheduler.drop_zero_variance_groups
