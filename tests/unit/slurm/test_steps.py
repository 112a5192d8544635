"""The srun steps of a deployment: placement, command lines and the errors for configs that
cannot be placed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.deployment import validate_config
from services.slurm.steps import deployment_steps

CONFIG = Path("/shared/run/deploy.toml")


def _config(rollout: dict[str, Any] | None = None, **slurm: Any) -> Any:
    data: dict[str, Any] = {
        "run": {"admin_token": "a-token-of-some-length", "grpc_token": "a-grpc-token",
                "engine_api_key": "an-engine-key"},
        "redis": {"url": "redis://head:6379/0", "password": "a-redis-password-of-length"},
        "rollout": {"host": "head", **(rollout or {}),
                    "fleet": {"kind": "attach", "model_path": "/m/fp8",
                              "attach_urls": ["http://n2:30000", "http://n4:30000"]}},
        "trainer": {"host": "n0", "parallel": {"launcher": "external"}},
        "slurm": {"head_node": "n0", "trainer_nodes": ["n0", "n1"], "trainer_ranks_per_node": 4,
                  "engine_nodes": ["n2", "n3", "n4", "n5"], "nodes_per_engine": 2, **slurm},
    }
    return validate_config(data)


def test_steps_are_placed_and_ordered() -> None:
    steps = deployment_steps(_config(), CONFIG)
    assert [s.name for s in steps] == ["redis", "engine-0", "engine-1", "router", "sandbox",
                                       "rollout", "trainer"]
    by_name = {s.name: s for s in steps}
    assert by_name["engine-1"].nodes == ["n4", "n5"]
    engine = by_name["engine-0"].command
    assert engine[:2] == ["bash", "-c"] and '--node-rank "$SLURM_NODEID"' in engine[2]
    assert "--nnodes 2 --dist-init-addr n2:30100" in engine[2]
    trainer = by_name["trainer"]
    assert trainer.env == {"MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    argv = trainer.srun_argv(Path("logs"), ["--container-image=img"])
    assert "--ntasks=8" in argv and "--nodelist=n0,n1" in argv and "--overlap" in argv
    assert argv.index("--container-image=img") < argv.index("-m")
    assert by_name["redis"].ready_url == "tcp://head:6379"
    assert by_name["engine-0"].ready_url == "http://n2:30000/health"


def test_configs_that_cannot_be_placed_say_why() -> None:
    with pytest.raises(ConfigError, match="one attach_urls entry per engine"):
        deployment_steps(_config(nodes_per_engine=1), CONFIG)
    with pytest.raises(ConfigError, match="do not split into engines of nodes_per_engine = 3"):
        _config(nodes_per_engine=3)
    with pytest.raises(ConfigError, match="slurm.head_node and slurm.trainer_nodes"):
        deployment_steps(_config(head_node=""), CONFIG)
    with pytest.raises(ConfigError, match="built-in engine runs on one node"):
        deployment_steps(_config(engine_program="builtin"), CONFIG)
    config = _config()
    config.trainer.parallel.launcher = "local"
    with pytest.raises(ConfigError, match="8 ranks, which srun starts"):
        deployment_steps(config, CONFIG)


def test_score_mode_runs_no_redis_and_no_trainer_and_ends_with_its_result(tmp_path: Path
                                                                           ) -> None:
    from services.slurm.supervisor import scoring_done

    result = tmp_path / "result.json"
    score = {"mode": "score", "eval": {"result_path": str(result)}}
    config = _config(score, trainer_nodes=[])
    assert [s.name for s in deployment_steps(config, CONFIG)] == [
        "engine-0", "engine-1", "router", "sandbox", "rollout"]
    with pytest.raises(ConfigError, match="runs no trainer: leave slurm.trainer_nodes empty"):
        deployment_steps(_config(score), CONFIG)
    assert not scoring_done(config, "rollout", 0), "no result file yet"
    result.write_text("{}")
    assert scoring_done(config, "rollout", 0)
    assert not scoring_done(config, "rollout", 1) and not scoring_done(config, "router", 0)
    assert not scoring_done(_config(), "rollout", 0), "train mode never ends so"
