"""The deployment config: defaults, precise errors, overrides, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import RedisConfig, dump_config, parse_override
from services.common.errors import ConfigError
from services.common.redis_server_config import server_config
from services.deployment import load_config, secrets_of, validate_config

MINIMAL = '[run]\nadmin_token = "0123456789"\n'


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


def test_minimal_file_gets_a_section_per_service(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, MINIMAL))
    assert config.run.name == "local"
    assert config.router.grpc_port == 50051
    assert config.redis.url.startswith("redis://")
    for section in ("router", "rollout", "sandbox", "trainer", "engine"):
        assert getattr(config, section) is not None


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL + "[router]\ngrpc_prot = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "router.grpc_prot" in str(err.value)


def test_out_of_range_value_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="router.grpc_port"):
        load_config(_write(tmp_path, MINIMAL + "[router]\ngrpc_port = 70000\n"))


def test_missing_token_and_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run.admin_token"):
        load_config(_write(tmp_path, "[run]\nname = 'x'\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[run\n"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_overrides_are_typed_and_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL)
    config = load_config(path, ["router.grpc_port=6000", "run.name=exp-7"])
    assert config.router.grpc_port == 6000 and config.run.name == "exp-7"
    with pytest.raises(ConfigError, match="router.grpc_port"):
        load_config(path, ["router.grpc_port=many"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("router.grpc_port")


def test_dump_round_trips(tmp_path: Path) -> None:
    config = validate_config({"run": {"admin_token": "0123456789"},
                              "router": {"grpc_port": 7001}})
    again = load_config(_write(tmp_path, dump_config(config)))
    assert again.model_dump() == config.model_dump()


def test_secrets_come_from_the_environment_over_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text(MINIMAL)
    monkeypatch.setenv("RIPTIDE_ADMIN_TOKEN", "admin-from-env")
    monkeypatch.setenv("RIPTIDE_GRPC_TOKEN", "grpc-from-env")
    monkeypatch.setenv("RIPTIDE_ENGINE_API_KEY", "engine-from-env")
    monkeypatch.setenv("RIPTIDE_REDIS_PASSWORD", "redis-password-from-env")
    config = load_config(path)
    assert (config.run.admin_token, config.run.grpc_token) == ("admin-from-env", "grpc-from-env")
    assert config.run.engine_api_key == "engine-from-env"
    assert config.redis.password == "redis-password-from-env"
    assert secrets_of(config) == {"admin token": "admin-from-env", "grpc token": "grpc-from-env",
                                  "engine api key": "engine-from-env",
                                  "redis password": "redis-password-from-env"}
    # Never in a repr, and messages describe the login without the secret.
    assert "redis-password-from-env" not in repr(config.redis)
    assert "redis-password-from-env" not in config.redis.describe()
    assert "user riptide, password set" in config.redis.describe()


def test_redis_settings_say_how_to_fix_them() -> None:
    with pytest.raises(ValueError, match="use a rediss:// url"):
        RedisConfig(url="redis://h:1/0", tls_ca_file="ca.pem")
    with pytest.raises(ValueError, match="tls_cert_file and redis.tls_key_file together"):
        RedisConfig(url="rediss://h:1/0", tls_cert_file="server.pem")
    with pytest.raises(ValueError, match="url holds credentials"):
        RedisConfig(url="redis://riptide:secret@h:1/0")
    with pytest.raises(ValueError, match="expected redis://host:port/db"):
        RedisConfig(url="http://h:1/0")
    with pytest.raises(ValueError, match="at least 16 characters"):
        RedisConfig(password="short")


def test_a_redis_without_a_password_is_never_started() -> None:
    with pytest.raises(ConfigError, match="Redis always requires authentication"):
        server_config(RedisConfig(), ["127.0.0.1"], Path("/data"))
