"""The stack's Redis started as each deployment starts it (`riptide up`, compose's command on
its config, the Slurm redis step of the recipe) refuses a client without the deployment's
login (NOAUTH, WRONGPASS) and serves the configured one; its password is on no command line
and in no file but the deployment's own. Everything binds loopback here."""

from __future__ import annotations

import importlib.util
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common import process
from services.common.config import RedisConfig, dump_config
from services.common.redis_connect import connect, pings
from services.common.redis_server_config import CONFIG_NAME
from services.local_stack import LocalStack, local_config
from services.slurm.steps import deployment_steps
from services.testing.proc_tree import descendants
from services.testing.redis_server import find_redis_server, free_port

REPO = Path(__file__).resolve().parents[2]


def _wait_for(config: RedisConfig, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not pings(config):
        assert proc.poll() is None, log.read_text() if log.exists() else "(no log)"
        assert time.monotonic() < deadline, "redis did not answer the configured login"
        time.sleep(0.1)


def _cmdlines(pid: int) -> list[str]:
    out = []
    for each in {pid} | descendants(pid):
        try:
            out.append(Path(f"/proc/{each}/cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            continue
    return out


def _check_login(config: RedisConfig, data_dir: Path, pid: int) -> None:
    """Refused without the login, served with it; the secret is in no argv and no redis.conf."""
    host, port = config.host, config.port
    with redis.Redis(host=host, port=port, protocol=2) as anonymous:
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            anonymous.xlen("riptide:t:samples")  # NOAUTH
    wrong = config.model_copy(update={"password": secrets.token_urlsafe(24)})
    with connect(wrong, protocol=2) as client:
        with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
            client.ping()  # WRONGPASS
    with redis.Redis(host=host, port=port, password=config.password, protocol=2) as default:
        with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
            default.ping()  # the default user is off, whatever the password
    with connect(config) as client:
        assert client.xadd("riptide:t:samples", {"group": b"g"})
        assert client.xlen("riptide:t:samples") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_set("dir", "/tmp")  # no file writes through CONFIG SET dir
    assert config.password is not None
    assert not any(config.password in line for line in _cmdlines(pid))
    conf = data_dir / CONFIG_NAME
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert config.password not in conf.read_text()
    assert f"bind {host}" in conf.read_text().splitlines()


def test_riptide_ups_redis(tmp_path: Path) -> None:
    config_path = tmp_path / "config.toml"
    config_path.write_text(dump_config(local_config(tmp_path)))
    said: list[str] = []
    stack = LocalStack(tmp_path, config_path, say=said.append)
    try:
        stack._start_redis()
        _check_login(stack.config.redis, tmp_path / "redis", stack.supervisor.proc("redis").pid)
    finally:
        stack.supervisor.stop_all()
    assert any("ACL user 'riptide' with a password" in line and "bound to 127.0.0.1" in line
               for line in said), said
    assert not any(str(stack.config.redis.password) in line for line in said)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        process.stop(proc)


def test_composes_redis(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """The compose file's redis command and environment on its mounted config, with the
    container's paths and address swapped for a temp dir and loopback."""
    find_redis_server()
    service = yaml.safe_load((REPO / "docker-compose.yaml").read_text())["services"]["redis"]
    port, password = free_port(), secrets.token_urlsafe(32)
    config_file = tmp_path / "config.toml"
    config_file.write_text((REPO / "deploy" / "compose.toml").read_text().replace(
        'url = "redis://redis:6379/0"', f'url = "redis://127.0.0.1:{port}/0"'))
    swap = {"/etc/riptide/config.toml": str(config_file), "0.0.0.0": "127.0.0.1",
            "/data": str(tmp_path / "data")}
    assert set(swap) <= set(service["command"]), service["command"]
    argv = [sys.executable, "-m", "services.cli", *(swap.get(a, a) for a in service["command"])]
    assert list(service["environment"]) == ["RIPTIDE_REDIS_PASSWORD"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RIPTIDE_REDIS_PASSWORD": password}
    log = tmp_path / "redis.log"
    spawned.append(process.spawn(argv, log_path=log, env=env, cwd=REPO))
    config = RedisConfig(url=f"redis://127.0.0.1:{port}/0", password=password)
    _wait_for(config, spawned[0], log)
    _check_login(config, tmp_path / "data", spawned[0].pid)


def _recipe() -> Any:
    spec = importlib.util.spec_from_file_location(
        "glm52_recipe_redis", REPO / "examples" / "glm52_tbench2" /
        "run_glm5_2_744b_a40b_daytona.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slurms_redis_step(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """The recipe's smoke deployment on loopback: its redis step's command, run without srun."""
    find_redis_server()
    recipe = _recipe()
    args = recipe._parser().parse_args(["train", "--smoke", "--head-address", "127.0.0.1",
                                        "--output-dir", str(tmp_path)])
    config = recipe.build(args)[0]
    config.redis.url = f"redis://127.0.0.1:{free_port()}/0"
    config_path = tmp_path / "deploy.toml"
    config_path.write_text(dump_config(config))
    config_path.chmod(0o600)
    step = next(s for s in deployment_steps(config, config_path) if s.name == "redis")
    log = tmp_path / "redis.log"
    spawned.append(process.spawn(step.command, log_path=log, cwd=REPO))
    _wait_for(config.redis, spawned[0], log)
    _check_login(config.redis, Path(config.slurm.redis_dir), spawned[0].pid)
