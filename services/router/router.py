"""Routing one generate call: choose a target, forward it, retry only where it is safe.

Called by the gRPC servicer and the HTTP front with an SGLang /generate body (streamed or
not). A call that never reached an engine
(no connection, 503) is retried on another target, up to `max_retries` times; a call that may
have started generating is never retried. Every served call updates the per-target counters
and metrics that the bench and the admin API read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from services.common.bounds import check_prompt_tokens
from services.common.errors import DeadlineExceeded, RiptideError, Unavailable
from services.router import metrics
from services.router.config import RouterConfig
from services.router.engine_calls import EngineCallFailed, EngineCalls, EngineNotReached
from services.router.health import HealthChecker
from services.router.policies import Choice, Policy, make_policy
from services.router.registry import EngineRegistry
from services.router.targets import Target

log = logging.getLogger(__name__)
_Reply = TypeVar("_Reply")
_DONE = b"data: [DONE]"


@dataclass
class RoutedReply:
    """An engine's /generate answer and where it came from."""

    body: dict[str, Any]
    target: Target
    engine_latency_s: float


class Router:
    """Owns the policy; routes calls over the registry's targets."""

    def __init__(self, config: RouterConfig, registry: EngineRegistry, health: HealthChecker,
                 calls: EngineCalls) -> None:
        self.config = config
        self.registry = registry
        self.health = health
        self.calls = calls
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

    def check_prompt(self, body: dict[str, Any]) -> None:
        """Refuse at once a prompt longer than any registered engine takes (an engine would
        refuse it only after reading it whole, seconds later for a large one)."""
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids:  # one prompt, or a batch of them (lists)
            longest = max((len(i) for i in ids if isinstance(i, list)), default=len(ids))
            check_prompt_tokens(longest, self.registry.max_input_tokens())

    async def generate(self, session_key: str, body: dict[str, Any]) -> RoutedReply:
        """Route one SGLang /generate body and return the engine's answer."""
        self.check_prompt(body)
        target, reply = await self._route(session_key, body, self.calls.generate)
        meta = reply.get("meta_info") or {}
        return RoutedReply(reply, target, float(meta.get("e2e_latency") or 0.0))

    async def stream(self, session_key: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """Route a streaming /generate body; yields the engine's SSE lines unchanged."""
        self.check_prompt(body)
        target, response = await self._route(session_key, body, self.calls.stream,
                                             keep_in_flight=True)
        last, served = b"", False
        try:
            async for line in response.lines():
                if line.startswith(b"data:") and not line.startswith(_DONE):
                    last = line
                yield line + b"\n"
            served = True
        except (EngineCallFailed, DeadlineExceeded) as exc:
            self._failed(target, "failed", exc)
            raise Unavailable(f"{target.id}: stream broke ({exc}); "
                              "not retried: generation had started") from exc
        finally:
            self._release(target)
            await response.close()
        if served:
            self._served(session_key, target, _last_chunk(last))

    async def _route(self, session_key: str, body: dict[str, Any],
                     send: Callable[[str, dict[str, Any]], Awaitable[_Reply]],
                     keep_in_flight: bool = False) -> tuple[Target, _Reply]:
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
                reply = await self._call(target, body, send, keep_in_flight)
            except EngineNotReached as exc:
                excluded.add(id(target))
                last_error = exc
                continue
            if not keep_in_flight:
                self._served(session_key, target, reply)  # type: ignore[arg-type]
            return target, reply
        raise Unavailable(f"no engine reached after {self.config.max_retries + 1} attempts: "
                          f"{last_error}")

    async def _call(self, target: Target, body: dict[str, Any],
                    send: Callable[[str, dict[str, Any]], Awaitable[_Reply]],
                    keep_in_flight: bool) -> _Reply:
        if target.engine.dp_aware:
            body = {**body, "routed_dp_rank": target.dp_rank}
        target.in_flight += 1
        metrics.series(target).in_flight.inc()
        ok = False
        try:
            reply = await send(target.engine.url, body)
            ok = True
        except EngineNotReached as exc:
            self._failed(target, "not_reached", exc, connect="cannot connect" in str(exc))
            raise
        except EngineCallFailed as exc:
            self._failed(target, "failed", exc)
            raise Unavailable(f"{exc} (not retried: generation may have started)") from exc
        except RiptideError as exc:
            self._failed(target, "error", exc)
            raise
        finally:
            if not (ok and keep_in_flight):
                self._release(target)
        return reply

    def _release(self, target: Target) -> None:
        target.in_flight -= 1
        metrics.series(target).in_flight.dec()

    def end_session(self, session_key: str) -> bool:
        """The session is over: it stops counting as live on its target."""
        return self.policy.end_session(session_key)

    def _failed(self, target: Target, outcome: str, cause: Exception,
                connect: bool = False) -> None:
        log.warning("generate failed", extra={"engine": target.engine.url,
                                              "dp_rank": target.dp_rank, "outcome": outcome,
                                              "cause": str(cause)})
        metrics.REQUESTS.labels(*metrics.labels(target), outcome).inc()
        if target.record_call(False, self.config.circuit_open_after_failures,
                              self.config.circuit_open_s):
            metrics.CIRCUIT_OPENS.labels(*metrics.labels(target)).inc()
        if connect:  # a refused connection is as good as a failed health check
            self.health.observe_health(target.engine, False)

    def _served(self, session_key: str, target: Target, reply: dict[str, Any]) -> None:
        meta = reply.get("meta_info") or {}
        prompt, cached = int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0)
        target.record_call(True, self.config.circuit_open_after_failures,
                           self.config.circuit_open_s)
        target.num_requests += 1
        target.num_prompt_tokens += prompt
        target.num_cached_tokens += cached
        latency = float(meta.get("e2e_latency") or 0.0)
        if latency:
            target.observe_latency(latency)
        if session_key:
            self.policy.on_served(session_key, target,
                                  prompt + int(meta.get("completion_tokens") or 0))
        series = metrics.series(target)
        series.served.inc()
        series.prompt_tokens.inc(prompt)
        series.cached_tokens.inc(cached)
        series.call_latency.observe(latency)
        version = meta.get("weight_version")
        if version is not None:
            self.health.observe_version(target.engine, str(version))

    def state(self) -> dict[str, Any]:
        version, open_after = self.registry.weight_version, self.config.circuit_open_after_failures
        missing_after = self.config.unhealthy_after_failures
        targets = [t.view(version, open_after, missing_after) for t in self.registry.targets()]
        prompt = sum(t.num_prompt_tokens for t in self.registry.targets())
        cached = sum(t.num_cached_tokens for t in self.registry.targets())
        return {
            "policy": self.policy.name, **self.policy.state(),
            "weight_version": version, "num_targets": len(targets),
            "num_routable": sum(1 for t in targets if t["routable"]),
            "spills": self.num_spills, "retries": self.num_retries,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            # engines routed by the router's own in-flight counts alone (min_load on nothing)
            "no_load_signal": [e.url for e in self.registry.engines.values()
                               if e.load_signal(missing_after) == "missing"],
            "targets": targets,
        }


def _last_chunk(line: bytes) -> dict[str, Any]:
    """The JSON of a stream's last `data:` line ({} when it is not JSON)."""
    try:
        chunk = orjson.loads(line[5:].strip() or b"{}")
    except orjson.JSONDecodeError:
        return {}
    return chunk if isinstance(chunk, dict) else {}
