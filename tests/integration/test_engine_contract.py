"""The SGLang contract suite: every engine-facing call of Riptide, against the built-in engine
serving SGLang 0.5.23's routes (`--contract current`) and only the older ones
(`--contract deprecated`), and each behaviour where 0.5.23 differs from older trees.

Written from SGLang's documented behaviour and source (http_server.py, io_struct.py,
weight_versions.py); one engine process per contract mode.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from services._proto.riptide.v1 import router_pb2
from services.common import process
from services.common.engine_client import EngineClient
from services.common.ports import free_port
from services.common.tensor_payload import encode
from services.router.config import RouterConfig
from services.router.engine_calls import EngineCalls
from services.router.health import HealthChecker
from services.router.registry import EngineRegistry
from services.router.servicer import generate_body
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.weight_broadcaster import load_state_dict, update_request
from services.trainer.weights.weight_sync import DirectEngineWeightSync

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
CURRENT_ONLY = ("/model_info", "/server_info", "/v1/loads")
OLD = ("/get_model_info", "/get_server_info", "/get_load")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["current", "deprecated"])
def engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[EngineProcess]:
    args = ["--contract", request.param, "--context-length", "256"]
    with EngineProcess(model_path, dp_size=2, extra_args=args) as proc:
        proc.contract = request.param  # type: ignore[attr-defined]
        yield proc


def error_message(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    return str(resp.json()["error"]["message"])


def stream(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    chunks: list[Any] = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return resp.status_code, chunks


class Background:
    """One /generate call on a thread; `.result` once it returns."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        self.result = httpx.post(f"{url}/generate", json=body, timeout=120).json()

    def join(self) -> Any:
        self.thread.join(60)
        return self.result


def wait_running(engine: EngineProcess, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while sum(r["num_reqs"] for r in engine.get("/get_load").json()) < count:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_routes_of_the_contract(engine: EngineProcess) -> None:
    current = engine.contract == "current"  # type: ignore[attr-defined]
    for path in CURRENT_ONLY:
        assert engine.get(path).status_code == (200 if current else 404), path
    for path in OLD:  # 0.5.23 keeps them as deprecated aliases
        assert engine.get(path).status_code == 200, path
    assert engine.get("/get_weight_version").status_code == (404 if current else 200)
    assert engine.get("/server_info" if current else "/get_server_info").json()[
        "sglang_contract"] == ("0.5.23" if current else "pre-0.5.23")


def test_every_riptide_engine_call(engine: EngineProcess) -> None:
    """The calls of the rollout service, the router and the trainer, through their code."""
    mode = engine.contract  # type: ignore[attr-defined]
    request = router_pb2.GenerateRequest(session_key="s", input_ids=[5, 6, 7],
                                         return_logprob=True, request_id="s-1")
    request.sampling_params.max_new_tokens = 4
    request.sampling_params.temperature = 0.0
    request.sampling_params.ignore_eos = True

    async def calls() -> dict[str, Any]:
        client = EngineClient(timeout_s=60)
        calls = EngineCalls(timeout_s=60, connect_timeout_s=5, max_connections=4)
        url = engine.url
        try:
            contract = await client.detect(url)
            registry = EngineRegistry(client, weight_version=None, probe_timeout_s=5)
            registered = await registry.register(url)
            await HealthChecker(registry, RouterConfig(engine_urls=[])).check(registered)
            out = {
                "mode": contract.mode, "healthy": await client.healthy(url),
                "info": await client.server_info(url), "version": await client.weight_version(url),
                "load": await client.load(url), "targets": len(registered.targets),
                "reply": await calls.generate(url, generate_body(request)),
            }
            await client.pause(url, "retract")
            await client.resume(url)
            await client.set_weight_version(url, 3)
            out["bumped"] = await client.weight_version(url)
            await client.abort(url)
            await client.abort(url, "no-such-rid")
            return out
        finally:
            await calls.close()
            await client.close()

    got = asyncio.run(calls())
    assert got["mode"] == mode and got["healthy"]
    assert got["info"]["dp_size"] == 2 and got["targets"] == 2
    assert [rank.dp_rank for rank in got["load"]] == [0, 1]
    assert got["version"] == "default" and got["bumped"] == "3"
    meta = got["reply"]["meta_info"]
    assert meta["id"] == "s-1" and len(meta["output_token_logprobs"]) == 4
    sync = SimpleNamespace(urls=[engine.url], http=httpx.Client(timeout=10))
    assert DirectEngineWeightSync._engine_tp_sizes(sync) == [1]  # type: ignore[arg-type]
    engine.post("/update_weight_version", {"new_version": "default"})


def test_generate_errors_and_refusals(engine: EngineProcess) -> None:
    message = error_message(engine.post("/generate", {"input_ids": [1] * 200,
                                                      "sampling_params": {"max_new_tokens": 56}}))
    assert "Requested token count exceeds" in message and "256" in message
    fits = engine.generate([1] * 200, sampling_params={"max_new_tokens": 55, "ignore_eos": True})
    assert fits["meta_info"]["completion_tokens"] == 55
    # unknown top-level fields are ignored, as SGLang's dataclass input ignores them
    assert engine.post("/generate", {"input_ids": [1], "ignore_eos": True, "bogus": 1,
                                     "sampling_params": GREEDY}).status_code == 200
    same = {"input_ids": [[1], [2]], "rid": ["x", "x"]}
    assert "Duplicate request ID" in error_message(engine.post("/generate", same))
    for body, word in (
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": [1], "routed_dp_rank": 5}, "routed_dp_rank"),
        ({"input_ids": [[1], [2]], "stream": True}, "streams one prompt"),
    ):
        if body.get("stream"):
            status, chunks = stream(engine.url, body)
            assert status == 200 and chunks[-1] == "[DONE]"
            assert word in chunks[0]["error"]["message"]
            continue
        assert word in error_message(engine.post("/generate", body)), body
    status, chunks = stream(engine.url, {"input_ids": [1] * 250,
                                         "sampling_params": {"max_new_tokens": 10}})
    assert status == 200 and chunks[-1] == "[DONE]" and len(chunks) == 2
    assert chunks[0]["error"] == {"message": chunks[0]["error"]["message"],
                                  "type": "BadRequestError", "code": 400, "retryable": False}
    for path in ("/update_weights_from_disk",):
        assert "not supported" in engine.post(path, {}).json().get(
            "message", engine.post(path, {}).text)


def test_duplicate_in_flight_rid_and_empty_abort(engine: EngineProcess) -> None:
    body = {"input_ids": [3, 4], "rid": "dup",
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    first = Background(engine.url, body)
    wait_running(engine)
    assert "Duplicate request ID" in error_message(engine.post("/generate", body))
    resp = engine.post("/abort_request", {"rid": "dup"})
    assert resp.status_code == 200 and resp.content == b""
    assert first.join()["meta_info"]["finish_reason"]["type"] == "abort"
    again = engine.generate([3, 4], rid="dup", sampling_params=GREEDY)  # free once finished
    assert again["meta_info"]["id"] == "dup"


def test_n_logit_bias_and_top_logprobs(engine: EngineProcess) -> None:
    group = engine.post("/generate", {"input_ids": [9, 8], "rid": "g", "sampling_params": {
        "n": 3, "temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True,
        "sampling_seed": 1}}).json()
    assert [r["meta_info"]["id"] for r in group] == ["g_0", "g_1", "g_2"]
    assert len({tuple(r["output_ids"]) for r in group}) > 1
    biased = engine.generate([9, 8], sampling_params={**GREEDY, "logit_bias": {"7": 100.0}})
    assert biased["output_ids"] == [7] * GREEDY["max_new_tokens"]
    out = engine.generate([9, 8, 7], sampling_params=GREEDY, return_logprob=True,
                          top_logprobs_num=3, logprob_start_len=0)
    meta = out["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out["output_ids"]) and all(len(t) == 3 for t in tops)
    for top, (logprob, token, _) in zip(tops, meta["output_token_logprobs"], strict=True):
        assert top[0][1] == token and abs(top[0][0] - logprob) < 1e-5  # greedy: the argmax
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 3


def test_weight_versions_span_an_in_place_update(engine: EngineProcess) -> None:
    # As long as the 256-token context allows, so the pause lands mid-request on a busy machine.
    new_tokens = 250
    body = {"input_ids": [4, 2],
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    running = Background(engine.url, body)
    wait_running(engine)
    time.sleep(0.05)
    assert engine.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    bump = {"new_version": "v2", "abort_all_requests": False}
    assert engine.post("/update_weight_version", bump).status_code == 200
    engine.post("/continue_generation")
    meta = running.join()["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"] and meta["weight_version"] == "v2"
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == meta["completion_tokens"] == new_tokens
    # 0.5.23's default: a version bump aborts what runs
    running = Background(engine.url, body)
    wait_running(engine)
    assert engine.post("/update_weight_version", {"new_version": "default"}).status_code == 200
    assert running.join()["meta_info"]["finish_reason"]["type"] == "abort"


def test_weights_by_name_tensor_update_and_tokenize(engine: EngineProcess,
                                                    model_path: Path) -> None:
    name = "model.norm.weight"
    original = load_state_dict(model_path)[name]
    got = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 5}).json()
    assert torch.allclose(torch.tensor(got), original[:5])
    assert "unknown parameter" in error_message(
        engine.post("/get_weights_by_name", {"name": "model.nope"}))

    def push(tensor: torch.Tensor, version: str) -> httpx.Response:
        return engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [encode([(name, tensor)])], "weight_version": version})

    assert push(original * 0 + 0.5, "t1").json()["success"]
    changed = engine.post("/get_weights_by_name", {"name": name}).json()
    assert changed == [0.5] * len(original)
    assert engine.get("/get_model_info").json()["weight_version"] == "t1"
    assert push(original, "default").status_code == 200
    bad = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]})
    assert bad.status_code == 400 and "base64" in bad.json()["message"]
    ids = engine.post("/tokenize", {"prompt": "hello"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 256
    assert engine.post("/detokenize", {"tokens": ids["tokens"]}).json()["text"] == "hello"


def test_metric_names(engine: EngineProcess) -> None:
    engine.generate([1, 2, 3], sampling_params=GREEDY)
    text = engine.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage",
                 "gen_throughput", "cache_hit_rate", "num_retracted_reqs",
                 "max_total_num_tokens", "num_grammar_queue_reqs",
                 "num_running_reqs_offline_batch", "num_paused_reqs", "utilization",
                 "engine_startup_time", "engine_load_weights_time", "prompt_tokens_total",
                 "generation_tokens_total", "cached_tokens_total", "num_requests_total",
                 "num_aborted_requests_total", "num_retracted_requests_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "queue_time_seconds_bucket"):
        assert f"sglang:{name}" in text, name


def broadcast(engine: EngineProcess, model_path: Path, group: str, tmp_path: Path,
              *flags: str) -> tuple[httpx.Response, int]:
    """Run a trainer rank 0 broadcasting the model's weights while the engine receives."""
    state = load_state_dict(model_path)
    port = free_port()
    trainer = process.spawn([sys.executable, "-m", "services.testing.weight_broadcaster",
                             "--model", str(model_path), "--master-port", str(port),
                             "--group-name", group, *flags],
                            log_path=tmp_path / f"{group}.log", cwd=REPO)
    try:
        init = engine.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": group, "backend": "gloo"})
        assert init.status_code == 200, init.text
        body = {**update_request(state, group_name=group, version=group),
                "selector": None, "torch_empty_cache": True}
        resp = engine.post("/update_weights_from_distributed", body)
        code = trainer.wait(60)
    finally:
        process.stop(trainer, grace_s=1)
    engine.post("/destroy_weights_update_group", {"group_name": group})
    return resp, code


def test_mismatched_broadcast_is_a_400_and_the_engine_lives_on(
        engine: EngineProcess, model_path: Path, tmp_path: Path) -> None:
    if engine.contract != "current":  # type: ignore[attr-defined]
        pytest.skip("the weight routes do not depend on the contract mode")
    before = engine.generate([5, 5, 5], sampling_params=GREEDY)["output_ids"]
    resp, code = broadcast(engine, model_path, "wrong-order", tmp_path, "--reversed")
    assert resp.status_code == 400 and resp.json()["success"] is False, resp.text
    assert "broadcast does not match" in resp.json()["message"] and code == 0
    assert engine.get("/health").status_code == 200
    assert engine.get("/get_model_info").json()["weight_version"] == "default"
    assert engine.generate([5, 5, 5], sampling_params=GREEDY)["output_ids"] == before
    resp, code = broadcast(engine, model_path, "right-order", tmp_path)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert engine.get("/get_model_info").json()["weight_version"] == "right-order"
    assert engine.generate([5, 5, 5], sampling_params=GREEDY)["output_ids"] == before
    engine.post("/update_weight_version", {"new_version": "default"})
