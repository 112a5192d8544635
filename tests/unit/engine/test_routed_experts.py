"""The engine's routed-experts recording in-process (tiny Qwen2-MoE): every forwarded
position's routes once, in batches and across a retraction, equal to the model's own routers
run on the whole sequence; and the request fields' errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidRequest
from services.common.tiny_model import create_tiny_model
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.generate_io import build_response, parse_generate
from services.engine.request import GenRequest, SamplingParams
from services.engine.routed_experts import RoutedExpertsRecorder

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("moe"), num_layers=LAYERS, num_experts=8)


def _whole_sequence_routes(model_path: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    recorder = RoutedExpertsRecorder(model)
    with torch.no_grad():
        model(torch.tensor([ids]))
    recorder.finish_forward()
    (routes,) = recorder.take_all()
    return routes.numpy()


def _routes(req: GenRequest, engine: Engine) -> np.ndarray:
    import base64

    update = req.snapshot(engine.weight_version)
    assert update.routed_experts is not None
    raw = base64.b64decode(build_response(req, update, engine.runner)["meta_info"]
                           ["routed_experts"])
    return np.frombuffer(raw, "<i4").reshape(-1, LAYERS, TOP_K)


def test_batched_and_retracted_requests_get_every_position_once(model_path: Path) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path), enable_return_routed_experts=True))
    sched = engine.schedulers[0]
    params = SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)
    reqs = [GenRequest(input_ids=[3 + i, 40, 41, 42, 43 + i], params=params,
                       return_routed_experts=True, routed_experts_start_len=s)
            for i, s in enumerate([0, 2])]
    plain = GenRequest(input_ids=[9, 8, 7], params=params)  # asks nothing, records nothing
    for req in [*reqs, plain]:
        engine.submit(req)
    for _ in range(4):
        sched.step()
    sched.retract()  # forwarded again from the prefix cache: no position twice, none missing
    while sched.step():
        pass
    assert plain.route_rows == []
    for req in reqs:
        ids = req.all_ids
        expected = _whole_sequence_routes(model_path, ids[:-1])[req.routed_experts_start_len :]
        got = _routes(req, engine)
        assert got.shape == (len(ids) - 1 - req.routed_experts_start_len, LAYERS, TOP_K)
        assert np.array_equal(np.sort(got, -1), np.sort(expected, -1))


def test_request_fields_are_checked(model_path: Path) -> None:
    plain = Engine(EngineConfig(model_path=str(model_path)))
    body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
    with pytest.raises(InvalidRequest, match="--enable-return-routed-experts"):
        parse_generate(body, plain.runner)
    engine = Engine(EngineConfig(model_path=str(model_path), enable_return_routed_experts=True))
    with pytest.raises(InvalidRequest, match=r"routed_experts_start_len must be .* \[0, 3\)"):
        parse_generate({**body, "routed_experts_start_len": 3}, engine.runner)
    (req,), _ = parse_generate({**body, "routed_experts_start_len": 1}, engine.runner)
    assert req.return_routed_experts and req.routed_experts_start_len == 1
    batch = {"input_ids": [[1, 2], [3, 4, 5]], "return_routed_experts": [False, True],
             "routed_experts_start_len": [0, 2]}
    reqs, _ = parse_generate(batch, engine.runner)
    assert [r.return_routed_experts for r in reqs] == [False, True]
    assert reqs[1].routed_experts_start_len == 2


def test_a_dense_model_cannot_record_routes(tmp_path: Path) -> None:
    from services.common.errors import ConfigError

    dense = create_tiny_model(tmp_path / "dense", num_layers=1)
    with pytest.raises(ConfigError, match="needs an MoE model"):
        Engine(EngineConfig(model_path=str(dense), enable_return_routed_experts=True))
