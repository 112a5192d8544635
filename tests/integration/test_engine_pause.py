"""Pause modes of the built-in engine with requests in flight: abort, retract, in_place."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.testing.engine_process import EngineProcess, tiny_model_path

pytestmark = pytest.mark.slow

PROMPT = [11, 22, 33, 44, 55]
LONG = {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(tiny_model_path(tmp_path_factory.mktemp("tiny"))) as proc:
        yield proc


@pytest.fixture(scope="module")
def uninterrupted(engine: EngineProcess) -> list[int]:
    return list(engine.generate(PROMPT, sampling_params=LONG)["output_ids"])


class StreamReader(threading.Thread):
    """Reads one streamed /generate in the background, keeping every chunk."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.chunks: list[dict[str, Any]] = []

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/generate", json=self.body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))

    def wait_for(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.chunks) < count:
            assert time.monotonic() < deadline and self.is_alive(), "stream stalled"
            time.sleep(0.005)


def assert_frozen(reader: StreamReader, seconds: float = 0.6) -> None:
    time.sleep(0.1)  # a chunk emitted just before the pause may still be in transit
    before = len(reader.chunks)
    time.sleep(seconds)
    assert len(reader.chunks) == before


def test_abort_returns_partial_output(engine: EngineProcess, uninterrupted: list[int]) -> None:
    reader = StreamReader(engine.url, {"input_ids": PROMPT, "sampling_params": LONG})
    reader.start()
    reader.wait_for(10)
    assert engine.post("/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    reader.join(30)
    last = reader.chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    partial = last["output_ids"]
    assert 10 <= len(partial) < LONG["max_new_tokens"]
    assert partial == uninterrupted[: len(partial)]
    # While paused, new requests wait in the queue; they run after continue.
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(engine.generate, PROMPT, sampling_params={"max_new_tokens": 4})
        time.sleep(0.3)
        assert not pending.done()
        assert engine.get("/get_load").json()[0]["num_waiting_reqs"] == 1
        engine.post("/continue_generation")
        assert len(pending.result(30)["output_ids"]) == 4


def test_retract_requeues_and_recomputes(engine: EngineProcess, uninterrupted: list[int]) -> None:
    reader = StreamReader(engine.url, {"input_ids": PROMPT, "sampling_params": LONG})
    reader.start()
    reader.wait_for(10)
    engine.post("/pause_generation", {"mode": "retract"})
    assert_frozen(reader)
    load = engine.get("/get_load").json()[0]
    assert load["num_waiting_reqs"] == 1 and load["num_tokens"] == 0
    engine.post("/continue_generation")
    reader.join(60)
    last = reader.chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["total_retractions"] == 1
    assert last["output_ids"] == uninterrupted


def test_in_place_freezes_and_resumes(engine: EngineProcess, uninterrupted: list[int]) -> None:
    reader = StreamReader(engine.url, {"input_ids": PROMPT, "sampling_params": LONG})
    reader.start()
    reader.wait_for(10)
    engine.post("/pause_generation", {"mode": "in_place"})
    assert_frozen(reader)
    load = engine.get("/get_load").json()[0]
    assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0 and load["num_tokens"] > 0
    assert engine.post("/flush_cache").status_code == 400
    engine.post("/continue_generation")
    reader.join(60)
    last = reader.chunks[-1]
    assert last["meta_info"]["total_retractions"] == 0
    assert last["output_ids"] == uninterrupted
    assert engine.post("/flush_cache").status_code == 200


def test_abort_request_by_rid(engine: EngineProcess) -> None:
    reader = StreamReader(engine.url, {"input_ids": PROMPT, "sampling_params": LONG, "rid": "r1"})
    reader.start()
    reader.wait_for(3)
    assert engine.post("/abort_request", {"rid": "r1"}).status_code == 200
    reader.join(30)
    assert reader.chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert reader.chunks[-1]["meta_info"]["id"] == "r1"


def test_unknown_pause_mode_is_rejected(engine: EngineProcess, tmp_path: Path) -> None:
    resp = engine.post("/pause_generation", {"mode": "sleep"})
    assert resp.status_code == 400 and "in_place" in resp.json()["error"]["message"]


def test_client_disconnect_aborts_the_request(engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    deadline = time.monotonic() + 10
    while engine.get("/get_load").json()[0]["num_reqs"]:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.05)
