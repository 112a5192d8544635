"""Start simulated engines (services/testing/sim_engine.py) as child processes and steer them.

Each engine runs in its own process group, so `kill()` (a crash) and `stop()` reach it and
nothing else. Used by the router's integration tests, bench/router.py and the rollout tests.
"""

from __future__ import annotations

import sys
from typing import Any

import httpx

from services.testing.child_server import ChildServer


class SimEngineProcess(ChildServer):
    """One simulated engine process on a free loopback port."""

    name = "sim-engine"
    stop_grace_s = 2.0

    def __init__(self, *, dp_size: int = 1, cache_tokens: int = 65536,
                 prefill_s_per_token: float = 2e-6, decode_s_per_token: float = 2e-4,
                 batch_slowdown: float = 0.0, max_running: int = 0, weight_version: str = "0",
                 dp_attention: bool = True, port: int = 0, max_input_tokens: int = 1 << 20,
                 contract: str = "deprecated", load_routes: str = "/get_load",
                 start_timeout_s: float = 15.0) -> None:
        cmd = [sys.executable, "-m", "services.testing.sim_engine", "--port", str(port),
               "--dp-size", str(dp_size), "--cache-tokens", str(cache_tokens),
               "--prefill-s-per-token", str(prefill_s_per_token),
               "--decode-s-per-token", str(decode_s_per_token),
               "--batch-slowdown", str(batch_slowdown), "--max-running", str(max_running),
               "--weight-version", weight_version, "--max-input-tokens", str(max_input_tokens),
               "--contract", contract, f"--load-routes={load_routes}"]
        if not dp_attention:
            cmd.append("--no-dp-attention")
        super().__init__(cmd, start_timeout_s)

    def control(self, **settings: Any) -> dict[str, Any]:
        """POST /sim/control: fail_health, fail_generate_status, fail_generate_count,
        context_len (prompts of at least that many tokens are refused as SGLang does; 0: off),
        decode_s_per_token."""
        return dict(httpx.post(f"{self.url}/sim/control", json=settings, timeout=5).json())

    def last_request(self) -> dict[str, Any]:
        """The body of the last /generate call the engine received."""
        return dict(httpx.get(f"{self.url}/sim/last_request", timeout=5).json())

    def set_weight_version(self, version: str | int) -> None:
        httpx.post(f"{self.url}/update_weight_version", json={"new_version": str(version)},
                   timeout=5).raise_for_status()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line)}


def start_sim_engines(count: int, **kwargs: Any) -> list[SimEngineProcess]:
    """Start `count` engines with the same settings; stops those started if one fails."""
    engines: list[SimEngineProcess] = []
    try:
        for _ in range(count):
            engines.append(SimEngineProcess(**kwargs))
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines
