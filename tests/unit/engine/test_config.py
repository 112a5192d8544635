"""The engine's command line and config section."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.engine.cli import parse_args
from services.engine.config import EngineConfig


def test_flags_build_the_config() -> None:
    config, ready = parse_args(
        ["--model", "/m", "--port", "0", "--dp-size", "2", "--ready-file", "/tmp/p"]
    )
    assert config.model_path == "/m" and config.port == 0 and config.dp_size == 2
    assert ready == "/tmp/p"
    assert config.torch_dtype_name == "float32"


def test_flags_override_the_deployment_file(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text(
        '[run]\nadmin_token = "secret-token"\n'
        '[engine]\nmodel_path = "/from-file"\ndp_size = 3\nmax_running_requests = 8\n'
    )
    config, _ = parse_args(["--config", str(path), "--dp-size", "1"])
    assert config.model_path == "/from-file" and config.dp_size == 1
    assert config.max_running_requests == 8


@pytest.mark.parametrize(
    "argv",
    [[], ["--model", "/m", "--dp-size", "0"], ["--model", "/m", "--dtype", "float16"]],
)
def test_bad_settings_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValueError):
        EngineConfig.model_validate({"max_runing_requests": 3})


def test_decode_backend_and_cuda_graph_flags() -> None:
    config, _ = parse_args(["--model", "/m", "--decode-backend", "slots", "--disable-cuda-graph"])
    assert config.decode_backend == "slots" and config.cuda_graph is False
    config, _ = parse_args(["--model", "/m"])
    assert config.decode_backend == "auto" and config.cuda_graph is True
    with pytest.raises(ConfigError, match="decode_backend"):
        parse_args(["--model", "/m", "--decode-backend", "vllm"])


def test_slots_need_room_for_a_sequence(tmp_path: Path) -> None:
    from services.common.tiny_model import create_tiny_model
    from services.engine.model_runner import ModelRunner

    path = create_tiny_model(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="raise max_total_num_tokens"):
        ModelRunner(EngineConfig(model_path=str(path), decode_backend="slots",
                                 max_total_num_tokens=64, max_running_requests=64))
    runner = ModelRunner(EngineConfig(model_path=str(path), decode_backend="slots",
                                      max_total_num_tokens=4096, max_running_requests=16))
    assert runner.context_len == 256  # one slot: 4096 tokens over 16 requests
    assert ModelRunner(EngineConfig(model_path=str(path))).decode_backend == "slots"  # auto
