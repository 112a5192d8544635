"""`plan --num-nodes 16` of the reference recipe: every listener on all interfaces wants a
credential, and no secret is on any command line or in the printed plan."""

from __future__ import annotations

import importlib.util
import shlex
import stat
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.common.redis_server_config import server_config
from services.deployment import secrets_of
from services.slurm.steps import Step, deployment_steps, engine_key_file
from services.slurm.supervisor import Supervisor

RECIPE = (Path(__file__).resolve().parents[3] / "examples" / "glm52_tbench2"
          / "run_glm5_2_744b_a40b_daytona.py")
ALL_INTERFACES = ("0.0.0.0", "::", "[::]")


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("glm52_recipe_security", RECIPE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = _recipe()


def _plan(tmp_path: Path, *flags: str) -> tuple[Any, list[Step], str]:
    args = recipe._parser().parse_args(["plan", "--num-nodes", "16", "--output-dir",
                                        str(tmp_path), *flags])
    config, hf, source = recipe.build(args)
    path = tmp_path / "deploy.toml"
    return (config, deployment_steps(config, path),
            recipe.plan_text(config, path, hf, source, args))


def _argv(step: Step) -> list[str]:
    """Every word of the step's command, the words inside `bash -c '...'` included."""
    words = list(step.command)
    if words[:2] == ["bash", "-c"]:
        words = words[:2] + shlex.split(words[2])
    return words


def _after(words: list[str], flag: str) -> str:
    assert flag in words, f"no {flag} in {words}"
    return words[words.index(flag) + 1]


def test_no_secret_on_any_command_line_or_in_the_plan(tmp_path: Path) -> None:
    config, steps, text = _plan(tmp_path)
    secrets = secrets_of(config)
    assert set(secrets) == {"admin token", "grpc token", "engine api key", "redis password"}
    for step in steps:
        shown = [*step.srun_argv(Path("logs"), config.slurm.srun_args), *step.env.values(),
                 *step.env_files.values()]
        for name, secret in secrets.items():
            assert not any(secret in word for word in shown), f"{name} in step {step.name}"
    for name, secret in secrets.items():
        assert secret not in text, f"the plan prints the {name}"
        assert f"<{name}>" in text, f"the plan's config does not say the {name} is set"
    assert "## Who may connect" in text and "ACL user 'riptide' with a password" in text


def test_every_listener_on_all_interfaces_wants_a_credential(tmp_path: Path) -> None:
    config, steps, _ = _plan(tmp_path)
    open_roles = set()
    for step in steps:
        words = _argv(step)
        if step.role == "redis":
            bind = _after(words, "--bind")
            # The step writes this file from the deployment's [redis]: a login or nothing.
            conf = server_config(config.redis, [bind], Path("/data")).splitlines()
            assert "user default off resetpass ~* &* +@all -@admin" in conf
            assert any(line.startswith("user riptide on #") for line in conf)
            assert f"bind {bind}" in conf and "protected-mode yes" in conf
            assert _after(words, "--config").endswith("deploy.toml")
        elif step.role == "engine":
            bind = _after(words, "--host")
            assert config.run.engine_api_key and words[-2:] == [
                "--config", str(engine_key_file(config))], "an SGLang engine without its key"
        elif step.role in ("router", "sandbox", "rollout", "trainer"):
            section = getattr(config, step.role)
            bind = section.listen_host
            assert config.run.grpc_token and config.run.admin_token
        else:
            raise AssertionError(f"step {step.name}: a listener this test does not know")
        if bind in ALL_INTERFACES:
            open_roles.add(step.role)
    # The reference run spans nodes: these do listen on every interface, each with its key.
    assert open_roles == {"redis", "engine", "router", "sandbox", "rollout", "trainer"}


def test_the_engines_key_file_is_private(tmp_path: Path) -> None:
    config, _, _ = _plan(tmp_path)
    Supervisor(config, tmp_path / "deploy.toml")._write_secret_files()
    path = engine_key_file(config)
    assert path.read_text() == f'api-key: "{config.run.engine_api_key}"\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize(("section", "key", "says"), [
    ("redis", "password", "redis.password"),
    ("run", "engine_api_key", "run.engine_api_key"),
    ("run", "grpc_token", "run.grpc_token"),
])
def test_a_deployment_without_one_of_its_secrets_is_refused(
        tmp_path: Path, section: str, key: str, says: str) -> None:
    config, _, _ = _plan(tmp_path)
    setattr(getattr(config, section), key, None)
    with pytest.raises(ConfigError, match=f"needs its secrets: set {says}"):
        deployment_steps(config, tmp_path / "deploy.toml")


def test_with_http_tls_the_steps_are_probed_and_shown_over_https(tmp_path: Path) -> None:
    from services.common.config import HttpTlsConfig
    from services.slurm.plan import render_security

    config, plain_steps, _ = _plan(tmp_path)
    assert "plain HTTP" in render_security(config)
    tls = HttpTlsConfig(cert_file="/tls/server.pem", key_file="/tls/server-key.pem",
                        ca_file="/tls/ca.pem")
    config = config.model_copy(update={"run": config.run.model_copy(update={"http_tls": tls})})
    steps = deployment_steps(config, tmp_path / "deploy.toml")
    services = ("router", "sandbox", "rollout", "trainer")  # engines serve their own HTTP
    probes = {s.name: s.ready_url for s in steps if s.name in services}
    assert set(probes) == set(services)
    assert all(url.startswith("https://") and url.endswith("/readyz") for url in probes.values())
    assert all(s.ready_url.startswith("http://") for s in plain_steps if s.name in services)
    shown = render_security(config)
    assert "plain HTTP" not in shown and "over TLS (run.http_tls)" in shown
