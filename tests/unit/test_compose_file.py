"""docker-compose.yaml: valid for docker-compose, and every Riptide service's command and
environment accepted by `riptide serve` against the config the container mounts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import SERVICES, _parser
from services.deployment import load_config

REPO = Path(__file__).resolve().parents[2]
TOKEN = "compose-file-test-token"
SECRETS = {"RIPTIDE_ADMIN_TOKEN": TOKEN, "RIPTIDE_GRPC_TOKEN": "compose-grpc-token",
           "RIPTIDE_ENGINE_API_KEY": "compose-engine-key",
           "RIPTIDE_REDIS_PASSWORD": "compose-redis-password"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, variables set)."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (`make test-deps` installs it)")
    done = subprocess.run(["docker-compose", "config"], cwd=REPO, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", **SECRETS},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout))


def _mounted_config(service: dict[str, Any], container_path: str) -> Path:
    """The host file bound at `container_path` in the service's container."""
    for volume in service.get("volumes", []):
        if isinstance(volume, dict) and volume.get("target") == container_path:
            return Path(volume["source"])
        if isinstance(volume, str) and volume.split(":")[1] == container_path:
            return REPO / volume.split(":")[0]
    raise AssertionError(f"nothing mounted at {container_path}")


def _port(entry: str | dict[str, Any]) -> tuple[str, int]:
    """(host address, container port) of a published port, short or long syntax."""
    if isinstance(entry, dict):
        return entry.get("host_ip", "0.0.0.0"), int(entry["target"])
    host_ip, _, container = entry.rsplit(":", 2)
    return host_ip, int(container.split("/")[0])


def test_every_service_is_in_the_compose_file(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"redis", *SERVICES}
    images = {s.get("image") for s in compose["services"].values()}
    assert images == {"riptide:latest"}, "one image for every service, Redis included"


@pytest.mark.parametrize("name", SERVICES)
def test_service_command_is_accepted_by_riptide_serve(compose: dict[str, Any], name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose["services"][name]
    args = _parser().parse_args(service["command"])
    assert (args.command, args.service) == ("serve", name)
    for key, value in (service.get("environment") or {}).items():
        assert value is not None, f"{name}: environment {key} has no value"
        monkeypatch.setenv(key, str(value))  # as the container's `riptide serve` sees it
    config = load_config(_mounted_config(service, str(args.config)), args.set)
    assert config.run.admin_token == TOKEN
    # Every service holds every secret, from its environment: gRPC calls carry the token, the
    # fleet's engines want the key, Redis the password.
    assert (config.run.grpc_token, config.run.engine_api_key, config.redis.password) == (
        SECRETS["RIPTIDE_GRPC_TOKEN"], SECRETS["RIPTIDE_ENGINE_API_KEY"],
        SECRETS["RIPTIDE_REDIS_PASSWORD"])
    section = getattr(config, name)
    # Peers reach it by its compose name; its admin port is what is published and probed.
    assert section.host == name and section.bind_host == "0.0.0.0"
    published = [_port(p) for p in service["ports"]]
    assert ("127.0.0.1", section.admin_port) in published, published
    assert f"127.0.0.1:{section.admin_port}/readyz" in " ".join(service["healthcheck"]["test"])
    assert config.redis.url.startswith("redis://redis:")


def test_redis_runs_with_the_deployments_login(compose: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose's Redis is `riptide redis-server` on the mounted config: the password from the
    environment, none in its command or healthcheck."""
    service = compose["services"]["redis"]
    args = _parser().parse_args(service["command"])
    assert args.command == "redis-server" and args.bind == ["0.0.0.0"]
    assert not service.get("ports"), "Redis is reached on the compose network only"
    assert set(service["environment"]) == {"RIPTIDE_REDIS_PASSWORD"}
    monkeypatch.setenv("RIPTIDE_REDIS_PASSWORD", service["environment"]["RIPTIDE_REDIS_PASSWORD"])
    config = load_config(_mounted_config(service, str(args.config)))
    assert config.redis.password == SECRETS["RIPTIDE_REDIS_PASSWORD"]
    shown = " ".join([*service["command"], *service["healthcheck"]["test"]])
    for secret in SECRETS.values():
        assert secret not in shown
