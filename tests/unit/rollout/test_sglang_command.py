"""The engine command lines the fleet launches."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.engine_contract import API_KEY_ENV
from services.rollout.config import FleetConfig, SGLangConfig
from services.rollout.sglang_command import (
    engine_command,
    keyed_launch,
    ranks_per_engine,
    sglang_command,
)


def _flags(cmd: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, tok in enumerate(cmd):
        if tok.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[tok] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_reference_engine_shape() -> None:
    cfg = SGLangConfig(tp_size=4, dp_size=4, ep_size=4, enable_dp_attention=True,
                       quantization="fp8", kv_cache_dtype="fp8_e4m3", mem_fraction_static=0.85,
                       page_size=64, chunked_prefill_size=32768, max_running_requests=256,
                       cuda_graph_max_bs=32, extra_args=["--speculative-algorithm", "EAGLE"])
    cmd = sglang_command(cfg, "/models/glm-5.2-fp8", "10.0.0.5", 30000, 7)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _flags(cmd) == {
        "--model-path": "/models/glm-5.2-fp8", "--host": "10.0.0.5", "--port": "30000",
        "--tp-size": "4", "--dp-size": "4", "--ep-size": "4", "--enable-dp-attention": None,
        "--quantization": "fp8", "--kv-cache-dtype": "fp8_e4m3", "--mem-fraction-static": "0.85",
        "--page-size": "64", "--chunked-prefill-size": "32768", "--max-running-requests": "256",
        "--cuda-graph-max-bs": "32", "--enable-metrics": None, "--weight-version": "7",
        "--speculative-algorithm": "EAGLE",
    }
    assert cmd[-2:] == ["--speculative-algorithm", "EAGLE"]


def test_unset_flags_are_left_out() -> None:
    cmd = sglang_command(SGLangConfig(enable_metrics=False), "m", "127.0.0.1", 1, 0)
    assert set(_flags(cmd)) == {"--model-path", "--host", "--port", "--tp-size", "--dp-size",
                                "--weight-version"}


def test_builtin_engine_command_and_ranks() -> None:
    fleet = FleetConfig(kind="builtin", num_engines=2, model_path="/tmp/tiny",
                        builtin_args=["--dp-size", "2"])
    cmd = engine_command(fleet, "127.0.0.1", 4321, 3)
    assert cmd[1:3] == ["-m", "services.engine"]
    assert _flags(cmd) == {"--model": "/tmp/tiny", "--host": "127.0.0.1", "--port": "4321",
                           "--weight-version": "3", "--dp-size": "2"}
    assert ranks_per_engine(fleet) == 1
    sglang = FleetConfig(kind="sglang", num_engines=1, model_path="m",
                         sglang=SGLangConfig(tp_size=8))
    assert ranks_per_engine(sglang) == 8
    assert engine_command(sglang, "h", 1, 0)[2] == "sglang.launch_server"


def test_config_errors_say_how_to_fix() -> None:
    with pytest.raises(ValidationError, match="enable_dp_attention needs dp_size >= 2"):
        SGLangConfig(enable_dp_attention=True)
    with pytest.raises(ValidationError, match="set fleet.model_path"):
        FleetConfig(kind="sglang", num_engines=2)
    with pytest.raises(ValidationError, match="attach_urls"):
        FleetConfig(kind="attach")


KEY = "an-engine-key-0123"


def test_the_api_key_never_goes_on_a_command_line(tmp_path: Path) -> None:
    builtin = FleetConfig(kind="builtin", model_path="/m")
    args, env = keyed_launch(builtin, KEY, tmp_path, 0)
    assert args == [] and env is not None and env[API_KEY_ENV] == KEY
    assert KEY not in " ".join(engine_command(builtin, "127.0.0.1", 30000, 0))

    sglang = FleetConfig(kind="sglang", model_path="/m")
    args, env = keyed_launch(sglang, KEY, tmp_path, 3)
    assert env is None and args[0] == "--config" and KEY not in " ".join(args)
    path = Path(args[1])
    assert path.read_text() == f'api-key: "{KEY}"\n'  # SGLang's --config YAML spelling
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    assert keyed_launch(sglang, None, tmp_path, 0) == ([], None)


def _hf_config(folder: Path, **fields: object) -> str:
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 6, **fields}))
    return str(folder)


def test_moe_models_get_the_routed_experts_flag_and_their_route_shape(tmp_path: Path) -> None:
    from services.common.errors import ConfigError
    from services.rollout.sglang_command import ROUTED_EXPERTS_FLAG, fleet_route_shape

    qwen = _hf_config(tmp_path / "qwen", num_experts=64, num_experts_per_tok=8,
                      decoder_sparse_step=2, mlp_only_layers=[1])
    glm = _hf_config(tmp_path / "glm", n_routed_experts=256, num_experts_per_tok=8,
                     first_k_dense_replace=3)
    dense = _hf_config(tmp_path / "dense")
    moe = FleetConfig(kind="sglang", num_engines=1, model_path=qwen)
    assert fleet_route_shape(moe) == (2, 8)  # layers 3 and 5 (1 is kept dense)
    assert ROUTED_EXPERTS_FLAG in engine_command(moe, "h", 1, 0)
    builtin = FleetConfig(kind="builtin", num_engines=1, model_path=glm)
    assert fleet_route_shape(builtin) == (3, 8)
    assert ROUTED_EXPERTS_FLAG in engine_command(builtin, "h", 1, 0)
    off = FleetConfig(kind="sglang", num_engines=1, model_path=qwen, routed_experts=False)
    assert fleet_route_shape(off) is None
    assert ROUTED_EXPERTS_FLAG not in engine_command(off, "h", 1, 0)
    plain = FleetConfig(kind="sglang", num_engines=1, model_path=dense)
    assert fleet_route_shape(plain) is None
    assert ROUTED_EXPERTS_FLAG not in engine_command(plain, "h", 1, 0)
    with pytest.raises(ConfigError, match="is not an MoE model"):
        fleet_route_shape(FleetConfig(kind="sglang", num_engines=1, model_path=dense,
                                      routed_experts=True))
