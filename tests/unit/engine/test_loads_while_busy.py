"""The engine answers its load routes while its loop thread is busy with a long step: the
fleet reads a load that does not come back in time as a missed health check, and kills an
engine after a few in a row, so a slow CPU step must not look like a hang."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.http_server import create_app


@pytest.mark.parametrize("contract", ["current", "deprecated"])
def test_loads_answer_while_the_loop_thread_is_busy(tmp_path: Path, contract: str) -> None:
    from services.common.tiny_model import create_tiny_model

    model = create_tiny_model(tmp_path / "model", hidden_size=32, num_layers=1)
    engine = Engine(EngineConfig(model_path=str(model), contract=contract))
    engine.start()
    release = threading.Event()
    try:
        busy = engine.call(lambda: release.wait(30))  # a step that takes as long as we like
        with TestClient(create_app(engine)) as client:
            path = "/v1/loads" if contract == "current" else "/get_load"
            started = time.monotonic()
            reply = client.get(path, timeout=10)
            waited = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert not busy.done(), "the loop thread was still busy when the load was read"
        assert waited < 5, f"the load waited {waited:.1f} s for the loop thread"
        loads = reply.json()["loads"] if contract == "current" else reply.json()
        assert [row["dp_rank"] for row in loads] == [0]
    finally:
        release.set()
        engine.stop()
