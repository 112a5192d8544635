"""The health checker: every `health_interval_s`, ask each engine for /health, its weight
version and its load; eject an engine after consecutive failures, re-admit it after
consecutive successes. An ejected engine is asked every `readmit_probe_interval_s` in
between, so one that is back takes calls again soon (as a client pinned to it would find).
Re-admission alone does not make it routable: it must also report the router's current
weight version (targets.py decides routability). A healthy engine whose load reads fail
`unhealthy_after_failures` times in a row has "no load signal": it stays routable (the
router still counts its own in-flight calls there) and is reported in the router's state,
`riptide_router_load_signal` and the run dashboard's advisories.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.engine_contract import EngineLoad
from services.router import metrics
from services.router.config import RouterConfig
from services.router.registry import EngineRegistry
from services.router.targets import Engine

log = logging.getLogger(__name__)


class HealthChecker:
    """Periodic probes of every registered engine."""

    def __init__(self, registry: EngineRegistry, config: RouterConfig) -> None:
        self.registry = registry
        self.config = config
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_round = loop.time() + self.config.health_interval_s
        while True:
            await asyncio.sleep(max(0.0, min(self.config.readmit_probe_interval_s,
                                             next_round - loop.time())))
            try:
                if loop.time() >= next_round:
                    next_round = loop.time() + self.config.health_interval_s
                    await self.check_all()
                else:
                    await self.check_ejected()
            except Exception:  # noqa: BLE001 - one bad round must not stop health checking
                log.exception("health check round failed")

    async def check_ejected(self) -> None:
        """Probe only the ejected engines (between full rounds)."""
        ejected = [e for e in self.registry.engines.values() if not e.healthy and not e.leaving]
        if ejected:
            await asyncio.gather(*(self.check(engine) for engine in ejected))

    async def check_all(self) -> None:
        """Probe every engine once, concurrently."""
        engines = list(self.registry.engines.values())
        await asyncio.gather(*(self.check(engine) for engine in engines))
        version, open_after = self.registry.weight_version, self.config.circuit_open_after_failures
        for target in self.registry.targets():
            metrics.ROUTABLE.labels(*metrics.labels(target)).set(
                float(target.routable(version, open_after)))

    async def check(self, engine: Engine) -> None:
        client, timeout = self.registry.client, self.config.health_timeout_s
        ok = await client.healthy(engine.url, timeout)
        if ok:
            version, load = await asyncio.gather(self.registry.read_version(engine.url),
                                                 client.load(engine.url, timeout),
                                                 return_exceptions=True)
            if isinstance(version, str):
                self.observe_version(engine, version)
            loads = {} if isinstance(load, BaseException) else {r.dp_rank: r for r in load}
            self.observe_load(engine, load)
        else:
            loads = {}
        for target in engine.targets:  # a failed probe clears figures it can no longer vouch for
            rank = loads.get(target.dp_rank)
            target.reported_tokens = rank.num_tokens if rank else 0
            target.reported_waiting = rank.num_waiting_reqs if rank else 0
        self.observe_health(engine, ok)

    def observe_load(self, engine: Engine, load: list[EngineLoad] | BaseException) -> None:
        """Count one load read of a healthy engine: a signal that never arrives or stops
        arriving is reported (state, metrics, a warning), not read as an idle engine."""
        ok = not isinstance(load, BaseException) and bool(load)
        if not ok:
            metrics.LOAD_READ_FAILURES.labels(engine.url).inc()
        missing_after = self.config.unhealthy_after_failures
        change = engine.record_load(ok, missing_after)
        missing = engine.load_signal(missing_after) == "missing"
        metrics.LOAD_SIGNAL.labels(engine.url).set(0.0 if missing else 1.0)
        if change == "lost":
            log.warning("engine sends no load signal: routed by the router's own in-flight "
                        "counts only", extra={"url": engine.url, "error": str(load)[:300]})
        elif change == "back":
            log.info("engine load signal is back", extra={"url": engine.url})

    def observe_health(self, engine: Engine, ok: bool) -> None:
        """Count one health observation (a probe, or a call that could not connect)."""
        change = engine.record_health(ok, self.config.unhealthy_after_failures,
                                      self.config.healthy_after_successes)
        if change == "ejected":
            metrics.EJECTIONS.labels(engine.url).inc()
            log.warning("engine ejected", extra={"url": engine.url})
        elif change == "admitted":
            log.info("engine re-admitted", extra={"url": engine.url})
        if change:
            self.registry.notify()

    def observe_version(self, engine: Engine, version: str) -> None:
        if version != engine.weight_version:
            engine.weight_version = version
            self.registry.notify()

    async def refresh_versions(self) -> None:
        """Read every engine's weight version now (after the router's version changed)."""
        engines = list(self.registry.engines.values())
        versions = await asyncio.gather(*(self.registry.read_version(e.url) for e in engines))
        for engine, version in zip(engines, versions, strict=True):
            if version is not None:
                self.observe_version(engine, version)
