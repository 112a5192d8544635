"""The engine registry: which engines exist, their targets, and the current weight version.

Registration asks the engine for its server info (which also teaches the engine client the
SGLang contract it speaks): an engine with dp_size > 1 and DP attention becomes one target
per dp rank. The rollout service registers and deregisters
engines; the health checker and the router update their state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.common.engine_client import EngineCallError, EngineClient
from services.common.errors import InvalidRequest, NotFound, Unavailable, quote
from services.router.targets import Engine, Target

log = logging.getLogger(__name__)
_MAX_URL_CHARS = 2048


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if len(url) > _MAX_URL_CHARS:
        raise InvalidRequest(f"engine url {quote(url)!r} is longer than {_MAX_URL_CHARS} chars")
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest(f"engine url {quote(url)!r} must start with http:// or https://")
    return url


def max_input_tokens(info: dict[str, Any]) -> int | None:
    """The longest prompt an engine takes, from its server info: SGLang's `max_req_input_len`
    (the scheduler's), else `context_length` - 1 (None when it says neither)."""
    for key, less in (("max_req_input_len", 0), ("context_length", 1)):
        value = info.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > less:
            return value - less
    return None


class EngineRegistry:
    """Registered engines and their targets, in registration order."""

    def __init__(self, client: EngineClient, weight_version: int | None,
                 probe_timeout_s: float) -> None:
        self.client = client
        self.weight_version = weight_version
        self.probe_timeout_s = probe_timeout_s
        self.engines: dict[str, Engine] = {}
        self.generation = 0  # bumped whenever the set of targets changes
        self.changed = asyncio.Event()

    def targets(self) -> list[Target]:
        return [t for e in self.engines.values() for t in e.targets]

    def max_input_tokens(self) -> int | None:
        """The longest prompt some registered engine takes; None while any engine has not
        said (it might take more)."""
        limits = [e.max_input_tokens for e in self.engines.values() if not e.leaving]
        if not limits or None in limits:
            return None
        return max(limit for limit in limits if limit is not None)

    def notify(self, topology: bool = False) -> None:
        """Wake callers waiting for a routable target; `topology`: targets added or removed."""
        if topology:
            self.generation += 1
        self.changed.set()
        self.changed = asyncio.Event()

    async def register(self, url: str) -> Engine:
        """Add an engine (idempotent); its targets become routable once its version is current."""
        url = normalize_url(url)
        existing = self.engines.get(url)
        if existing is not None:
            # Registered again (a restart, or while draining out): keep it, re-read its version.
            existing.leaving = False
            try:  # it may have come back as another SGLang version, or another context
                info = await self.client.server_info(url, self.probe_timeout_s)
            except EngineCallError as exc:
                raise Unavailable(f"cannot register {url}: {exc}") from exc
            existing.max_input_tokens = max_input_tokens(info)
            existing.weight_version = await self.read_version(url)
            self.notify()
            return existing
        try:
            info = await self.client.server_info(url, self.probe_timeout_s)
        except EngineCallError as exc:
            raise Unavailable(f"cannot register {url}: {exc}") from exc
        engine = self._engine_from_info(url, info)
        engine.weight_version = await self.read_version(url)
        self.engines[url] = engine
        log.info("engine registered", extra={"url": url, "dp_size": engine.dp_size,
                                             "max_running": engine.max_running,
                                             "weight_version": engine.weight_version})
        self.notify(topology=True)
        return engine

    async def read_version(self, url: str) -> str | None:
        """The engine's weight version, or None while it cannot be read."""
        try:
            return await self.client.weight_version(url, self.probe_timeout_s)
        except EngineCallError:
            return None

    @staticmethod
    def _engine_from_info(url: str, info: Any) -> Engine:
        info = info if isinstance(info, dict) else {}
        dp_size = int(info.get("dp_size") or 1)
        dp_aware = dp_size > 1 and bool(info.get("enable_dp_attention"))
        # SGLang's max_running_requests is per dp rank under DP attention.
        max_running = int(info.get("max_running_requests") or 0)
        engine = Engine(url=url, dp_size=dp_size, dp_aware=dp_aware, max_running=max_running,
                        max_input_tokens=max_input_tokens(info))
        engine.targets = [Target(engine, rank) for rank in range(dp_size if dp_aware else 1)]
        return engine

    async def deregister(self, url: str, drain: bool, drain_timeout_s: float) -> None:
        """Remove an engine; with `drain`, stop routing to it and wait for its in-flight calls."""
        url = normalize_url(url)
        engine = self.engines.get(url)
        if engine is None:
            raise NotFound(f"engine {quote(url)} is not registered")
        engine.leaving = True
        self.notify()
        if drain:
            deadline = time.monotonic() + drain_timeout_s
            while any(t.in_flight for t in engine.targets) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if self.engines.get(url) is engine and engine.leaving:
            del self.engines[url]
            self.notify(topology=True)
        log.info("engine deregistered", extra={"url": url, "drain": drain})

    def find(self, url: str, dp_rank: int | None) -> list[Target]:
        """The targets of `url` (one rank, or all of them when dp_rank is None)."""
        engine = self.engines.get(normalize_url(url))
        if engine is None:
            raise NotFound(f"engine {quote(url)} is not registered")
        chosen = [t for t in engine.targets if dp_rank is None or t.dp_rank == dp_rank]
        if not chosen:
            raise NotFound(f"engine {quote(url)} has no dp rank {dp_rank}")
        return chosen

    def set_drain(self, url: str, dp_rank: int | None, draining: bool) -> list[Target]:
        targets = self.find(url, dp_rank)
        for target in targets:
            target.draining = draining
        self.notify()
        return targets
