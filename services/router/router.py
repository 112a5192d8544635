"""Routing one generate call: choose a target, forward it, retry only where it is safe.

Called by the gRPC servicer with an SGLang /generate body. A call that never reached an engine
(no connection, 503) is retried on another target, up to `max_retries` times; a call that may
have started generating is never retried. Every served call updates the per-target counters
and metrics that the bench and the admin API read.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from services.common.engine_client import EngineCallFailed, EngineClient, EngineNotReached
from services.common.errors import RiptideError, Unavailable
from services.router import metrics
from services.router.config import RouterConfig
from services.router.health import HealthChecker
from services.router.policies import Choice, Policy, make_policy
from services.router.registry import EngineRegistry
from services.router.targets import Target


@dataclass
class RoutedReply:
    """An engine's /generate answer and where it came from."""

    body: dict[str, Any]
    target: Target
    engine_latency_s: float


class Router:
    """Owns the policy; routes calls over the registry's targets."""

    def __init__(self, config: RouterConfig, registry: EngineRegistry, health: HealthChecker,
                 client: EngineClient) -> None:
        self.config = config
        self.registry = registry
        self.health = health
        self.client = client
        self.policy: Policy = make_policy(config.policy, config)
        self._policy_generation = -1
        self.num_spills = 0
        self.num_retries = 0

    def set_policy(self, name: str) -> None:
        """Switch policies live (the new one starts with no session memory)."""
        self.policy = make_policy(name, self.config)
        self.refresh_targets()

    def refresh_targets(self) -> None:
        """Hand the policy the target list again on the next call (its settings changed)."""
        self._policy_generation = -1

    def candidates(self, excluded: set[int]) -> list[Target]:
        version, open_after = self.registry.weight_version, self.config.circuit_open_after_failures
        return [t for t in self.registry.targets()
                if id(t) not in excluded and t.routable(version, open_after)]

    async def choose(self, session_key: str, excluded: set[int],
                     last_error: Exception | None = None) -> Choice:
        """A target for this call, waiting up to `wait_for_target_s` for one to be routable."""
        deadline = time.monotonic() + self.config.wait_for_target_s
        while True:
            if self._policy_generation != self.registry.generation:
                self.policy.on_targets_changed(self.registry.targets())
                self._policy_generation = self.registry.generation
            candidates = self.candidates(excluded)
            if candidates:
                started = time.perf_counter()
                choice = self.policy.select(session_key, candidates)
                metrics.ROUTING_LATENCY.observe(time.perf_counter() - started)
                if choice is not None:
                    return choice
            elif excluded and self.candidates(set()):
                raise Unavailable(f"no other engine to retry on: {last_error}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"no routable engine after {self.config.wait_for_target_s}s: "
                                  f"{self._why_none()}")
            changed = self.registry.changed
            try:
                await asyncio.wait_for(changed.wait(), min(remaining, 0.1))
            except TimeoutError:
                pass

    def _why_none(self) -> str:
        targets = self.registry.targets()
        if not targets:
            return "no engine registered"
        version = self.registry.weight_version
        parts = [f"{t.id} healthy={t.engine.healthy} version={t.engine.weight_version}"
                 f"(want {version}) draining={t.draining}" for t in targets[:8]]
        return "; ".join(parts)

    async def generate(self, session_key: str, body: dict[str, Any]) -> RoutedReply:
        """Route one SGLang /generate body and return the engine's answer."""
        excluded: set[int] = set()
        last_error: Exception | None = None
        for attempt in range(self.config.max_retries + 1):
            choice = await self.choose(session_key, excluded, last_error)
            target = choice.target
            if choice.spilled:
                self.num_spills += 1
                metrics.SPILLS.labels(*metrics.labels(target)).inc()
            if attempt:
                self.num_retries += 1
                metrics.RETRIES.labels(*metrics.labels(target)).inc()
            try:
                return await self._call(target, body)
            except EngineNotReached as exc:
                excluded.add(id(target))
                last_error = exc
        raise Unavailable(f"no engine reached after {self.config.max_retries + 1} attempts: "
                          f"{last_error}")

    async def _call(self, target: Target, body: dict[str, Any]) -> RoutedReply:
        if target.engine.dp_aware:
            body = {**body, "routed_dp_rank": target.dp_rank}
        labels = metrics.labels(target)
        target.in_flight += 1
        metrics.IN_FLIGHT.labels(*labels).inc()
        started = time.perf_counter()
        try:
            reply = await self.client.generate(target.engine.url, body)
        except EngineNotReached as exc:
            self._failed(target, "not_reached", connect="cannot connect" in str(exc))
            raise
        except EngineCallFailed as exc:
            self._failed(target, "failed")
            raise Unavailable(f"{exc} (not retried: generation may have started)") from exc
        except RiptideError:
            self._failed(target, "error")
            raise
        finally:
            target.in_flight -= 1
            metrics.IN_FLIGHT.labels(*labels).dec()
        elapsed = time.perf_counter() - started
        self._served(target, reply, elapsed)
        meta = reply.get("meta_info") or {}
        return RoutedReply(reply, target, float(meta.get("e2e_latency") or elapsed))

    def _failed(self, target: Target, outcome: str, connect: bool = False) -> None:
        metrics.REQUESTS.labels(*metrics.labels(target), outcome).inc()
        if target.record_call(False, self.config.circuit_open_after_failures,
                              self.config.circuit_open_s):
            metrics.CIRCUIT_OPENS.labels(*metrics.labels(target)).inc()
        if connect:  # a refused connection is as good as a failed health check
            self.health.observe_health(target.engine, False)

    def _served(self, target: Target, reply: dict[str, Any], elapsed: float) -> None:
        labels = metrics.labels(target)
        meta = reply.get("meta_info") or {}
        prompt, cached = int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0)
        target.record_call(True, self.config.circuit_open_after_failures,
                           self.config.circuit_open_s)
        target.num_requests += 1
        target.num_prompt_tokens += prompt
        target.num_cached_tokens += cached
        metrics.REQUESTS.labels(*labels, "ok").inc()
        metrics.PROMPT_TOKENS.labels(*labels).inc(prompt)
        metrics.CACHED_TOKENS.labels(*labels).inc(cached)
        metrics.CALL_LATENCY.labels(*labels).observe(elapsed)
        version = meta.get("weight_version")
        if version is not None:
            self.health.observe_version(target.engine, str(version))

    def state(self) -> dict[str, Any]:
        version, open_after = self.registry.weight_version, self.config.circuit_open_after_failures
        targets = [t.view(version, open_after) for t in self.registry.targets()]
        prompt = sum(t.num_prompt_tokens for t in self.registry.targets())
        cached = sum(t.num_cached_tokens for t in self.registry.targets())
        return {
            "policy": self.policy.name, **self.policy.state(),
            "weight_version": version, "num_targets": len(targets),
            "num_routable": sum(1 for t in targets if t["routable"]),
            "spills": self.num_spills, "retries": self.num_retries,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "targets": targets,
        }
