"""bench/gateway.py's pass-through hop (a real proxy process in front of a real simulated
engine), and the bench itself end to end at a small size: every path answers, and the last
line is the JSON that judges the target and splits the overhead."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from services.common.http1_client import Http1Client
from services.common.ports import free_port
from services.testing.proxy_hop_process import ProxyHopProcess
from services.testing.sim_engine_process import SimEngineProcess

REPO = Path(__file__).resolve().parents[2]


async def _post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    client = Http1Client(connect_timeout_s=5.0, read_timeout_s=30.0, max_connections=4)
    try:
        response = await client.post(url, path, body)
        try:
            return response.status, await response.read()
        finally:
            response.release()
    finally:
        await client.close()


def test_the_proxy_hop_passes_status_and_body_through() -> None:
    engine = SimEngineProcess(decode_s_per_token=0.0, prefill_s_per_token=0.0)
    try:
        with ProxyHopProcess(engine.url) as proxy:
            request = orjson.dumps({"input_ids": [5, 6, 7],
                                    "sampling_params": {"max_new_tokens": 2}})
            direct = asyncio.run(_post(engine.url, "/generate", request))
            hopped = asyncio.run(_post(proxy.url, "/generate", request))
            assert direct[0] == hopped[0] == 200
            assert len(orjson.loads(hopped[1])["output_ids"]) == 2
            # the engine's own refusal comes back as it was
            refused = asyncio.run(_post(proxy.url, "/generate", b"not json"))
            assert refused[0] == asyncio.run(_post(engine.url, "/generate", b"not json"))[0]
            assert refused[0] >= 400
    finally:
        engine.stop()


def test_the_proxy_hop_answers_502_when_its_target_is_gone() -> None:
    with ProxyHopProcess(f"http://127.0.0.1:{free_port()}") as proxy:
        status, body = asyncio.run(_post(proxy.url, "/generate", b"{}"))
    assert status == 502
    assert b"NotConnected" in body


def test_the_other_paths_send_prompts_as_long_as_the_gateways() -> None:
    """The direct, front and hop paths send prompts of the lengths the gateway's rendered
    conversation has at each turn (transformers 5's apply_chat_template once made them a
    2-key mapping's length)."""
    spec = importlib.util.spec_from_file_location("gateway_bench", REPO / "bench" / "gateway.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths = bench.prompt_lengths(3)
    assert lengths[0] > 100  # the system prompt and the task alone
    assert lengths[0] < lengths[1] < lengths[2]


@pytest.mark.slow
def test_the_bench_reports_every_path_and_splits_the_overhead() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gateway.py"), "--calls", "64", "--rounds", "2",
         "--engine-ms", "5", "--think-ms", "5"],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for label in ("concurrency_1", "concurrency_32", "capacity_32"):
        for path in ("direct", "http_front", "proxy_hop", "gateway"):
            assert summary[label][f"{path}_calls_per_s"] > 0
        # process CPU is read in clock ticks: a few calls may read 0
        assert summary[label]["proxy_hop_cpu_us_per_call"] >= 0
    for label in ("concurrency_1", "concurrency_32"):
        judged = summary[label]
        assert judged["gateway_vs_http_front"]["rounds"] == 2
        assert isinstance(judged["gateway_vs_http_front"]["met"], bool)
        # the gateway's overhead over the front is the hop's plus its own work
        split = (judged["proxy_hop_vs_http_front"]["mean_ms"]
                 + judged["gateway_vs_proxy_hop"]["mean_ms"])
        assert split == pytest.approx(judged["gateway_vs_http_front"]["mean_ms"], abs=2e-3)
    assert "gateway_vs_proxy_hop" not in summary["capacity_32"]
    assert isinstance(summary["met"], bool)
