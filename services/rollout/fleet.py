"""The engine fleet: launch or attach engines, keep them alive, register them with the router.

Owns one EngineMember per engine: its process (when launched here), its weight-update ranks
and whether it is in the trainer's current weight-update group. A launched engine that dies
is restarted on the same port; it comes back with the initial weights, so it is registered
with the router again only after the next weight update has brought it to the current
version (weight_update.py re-forms the group then, because the restarted engine has not
joined it). Calls engines through EngineClient and the router through a RouterLink; the
rollout service owns the fleet and the coordinator uses it.

The router is checked every health interval: engines it does not hold (it restarted, or was
not up when they were) are registered again, and its weight version is set again, so a
restarted router needs no restart of the rollout service. Registration never fails start-up.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.common import process
from services.common.engine_client import EngineCallError, EngineClient
from services.common.errors import Unavailable
from services.common.ports import free_ports
from services.rollout.config import FleetConfig
from services.rollout.router_link import RouterLink
from services.rollout.sglang_command import engine_command, keyed_launch, ranks_per_engine

log = logging.getLogger(__name__)

MemberState = Literal["starting", "ready", "awaiting_weights", "unreachable", "dead", "failed"]


@dataclass
class EngineMember:
    """One engine of the fleet."""

    url: str
    index: int
    port: int
    ranks: int = 1
    proc: subprocess.Popen[bytes] | None = None
    state: MemberState = "starting"
    registered: bool = False
    in_group: bool = False
    restarts: int = 0
    missed_checks: int = 0
    weight_version: int | None = None
    load: list[dict[str, Any]] | None = None
    error: str | None = None

    def view(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "registered": self.registered,
                "in_weight_group": self.in_group, "restarts": self.restarts,
                "weight_version": self.weight_version, "ranks": self.ranks, "load": self.load,
                "pid": self.proc.pid if self.proc else None, "error": self.error}


class EngineFleet:
    """Launches or attaches the configured engines and supervises them."""

    def __init__(self, config: FleetConfig, client: EngineClient, router: RouterLink,
                 weight_version: int, api_key: str | None = None) -> None:
        self.config = config
        self.api_key = api_key  # every launched engine requires it (the client sends it)
        self._secrets_dir: Path | None = None
        self.client = client
        self.router = router
        self.initial_version = weight_version
        self.current_version = weight_version
        self.members: list[EngineMember] = []
        self.lock = asyncio.Lock()   # held by a weight update; restarts wait for it
        self._supervisor: asyncio.Task[None] | None = None
        self._restarting: set[asyncio.Task[None]] = set()
        self.router_reregistrations = 0

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Bring every engine up, register the healthy ones, start supervision."""
        cfg = self.config
        if cfg.kind == "attach":
            self.members = [EngineMember(url=u.rstrip("/"), index=i, port=0)
                            for i, u in enumerate(cfg.attach_urls)]
        else:
            ports = ([cfg.base_port + i for i in range(cfg.num_engines)] if cfg.base_port
                     else free_ports(cfg.num_engines, cfg.engine_host))
            self.members = [EngineMember(url=f"http://{cfg.engine_host}:{p}", index=i, port=p,
                                         ranks=ranks_per_engine(cfg))
                            for i, p in enumerate(ports)]
            for member in self.members:
                self._spawn(member)
        await asyncio.gather(*(self._bring_up(m) for m in self.members))
        self._supervisor = asyncio.create_task(self._supervise())

    async def stop(self) -> None:
        """Stop supervision and every engine this fleet launched."""
        tasks = [t for t in [self._supervisor, *self._restarting] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(process.stop, m.proc, 10.0)
                               for m in self.members if m.proc is not None))
        if self._secrets_dir is not None:
            shutil.rmtree(self._secrets_dir, ignore_errors=True)

    def _spawn(self, member: EngineMember) -> None:
        cmd = engine_command(self.config, self.config.engine_host, member.port,
                             self.initial_version)
        if self.api_key and self._secrets_dir is None:
            self._secrets_dir = Path(tempfile.mkdtemp(prefix="riptide-engine-keys-"))
        extra, env = keyed_launch(self.config, self.api_key, self._secrets_dir or Path(),
                                  member.index)
        log_dir = self.config.log_dir
        log_path = Path(log_dir) / f"engine-{member.index}.log" if log_dir else None
        member.proc = process.spawn([*cmd, *extra], log_path=log_path, env=env)
        member.state = "starting"
        log.info("started engine %s (pid %d)", member.url, member.proc.pid)

    async def _bring_up(self, member: EngineMember) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.start_timeout_s
        while not await self.client.healthy(member.url):
            if member.proc is not None and member.proc.poll() is not None:
                member.state, member.error = "dead", f"exited with {member.proc.returncode}"
                return
            if loop.time() > deadline:
                member.state, member.error = "failed", "not healthy before start_timeout_s"
                return
            await asyncio.sleep(0.2)
        try:
            info = await self.client.server_info(member.url)  # also learns its SGLang contract
        except Unavailable:
            if self.config.kind == "attach":
                raise
            info = {}  # a launched engine's ranks are known; its contract is learned later
        if self.config.kind == "attach":
            member.ranks = self.config.ranks_per_engine or int(info.get("tp_size", 1))
        usage = info.get("memory_usage")  # the built-in engine's split (SGLang has none)
        if isinstance(usage, dict):
            log.info("engine %s memory: %s", member.url, ", ".join(
                f"{k.removesuffix('_bytes')} {v / 2**30:.2f} GiB" for k, v in usage.items()))
        member.error = None
        if self.current_version == self.initial_version:
            member.state, member.weight_version = "ready", self.current_version
            try:
                await self._register(member, attempts=3)
            except Unavailable as exc:  # the router is not up yet: the supervisor registers it
                log.warning("router not reachable for %s yet: %s", member.url, exc)
        else:
            member.state = "awaiting_weights"
            log.info("engine %s is up with initial weights; waits for the next update",
                     member.url)

    async def _register(self, member: EngineMember, attempts: int = 10) -> None:
        for attempt in range(1, attempts + 1):
            try:
                await self.router.register(member.url)
                break
            except Unavailable as exc:
                if attempt == attempts:
                    raise
                log.warning("registering %s failed, retrying: %s", member.url, exc)
                await asyncio.sleep(min(5.0, 0.5 * attempt))
        member.registered, member.state = True, "ready"
        member.weight_version = self.current_version

    # -- supervision -------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            for member in self.members:
                if member.proc is None or member.proc.poll() is None:
                    continue
                if member.restarts >= self.config.max_restarts:
                    member.state = "failed"
                    continue
                if not any(t.get_name() == member.url for t in self._restarting):
                    task = asyncio.create_task(self._restart(member), name=member.url)
                    self._restarting.add(task)
                    task.add_done_callback(self._restarting.discard)
            await asyncio.gather(*(self._poll(m) for m in self.members if m.state != "dead"),
                                 return_exceptions=True)
            if not self.lock.locked():  # a weight update registers its engines itself
                try:
                    await self.reconcile_router()
                except Unavailable as exc:
                    log.debug("router check: %s", exc)

    async def reconcile_router(self) -> int:
        """Register again every ready engine the router does not hold (a restarted router
        comes back empty) and restore its weight version; returns how many were registered."""
        view = await self.router.view()
        if view is None:
            return 0
        if view.weight_version is not None and view.weight_version != self.current_version \
                or view.weight_version is None and self.current_version != self.initial_version:
            await self.router.set_weight_version(self.current_version)
        # An engine missing health checks waits until it answers again: registering it makes
        # the router probe it, which would hold up this loop, the one that must find it hung.
        missing = [m for m in self.members if m.state == "ready" and m.missed_checks == 0
                   and (not m.registered or m.url not in view.engine_urls)]
        for member in missing:
            log.warning("router does not hold engine %s: registering it again", member.url)
            member.registered = False
            await self._register(member, attempts=1)
            self.router_reregistrations += 1
        return len(missing)

    def abandon(self, members: list[EngineMember]) -> None:
        """An update was abandoned after weights moved: these engines hold mixed weights.
        They leave the router (the caller deregisters) and wait for the next full update."""
        for member in members:
            member.in_group = False
            if member.state == "ready":
                member.state = "awaiting_weights"

    def can_generate(self) -> bool:
        """Whether some engine holds the current weights (or the fleet is still starting)."""
        return not self.members or any(m.state == "ready" for m in self.members)

    @property
    def needs_weights(self) -> bool:
        """Some engine is up but lacks the current weights (restarted, or an update was
        abandoned): the trainer should push them even if it has no step to take."""
        return any(m.state == "awaiting_weights" for m in self.members)

    async def _poll(self, member: EngineMember) -> None:
        asked_while_starting = member.state == "starting"
        try:
            member.load = await self._load(member.url)
        except Unavailable:
            member.load = None
            if member.proc is None and member.state in ("ready", "awaiting_weights"):
                # an attached engine we cannot restart: it may come back without our weights
                member.state, member.in_group = "unreachable", False
            elif member.proc is not None and member.state != "starting" \
                    and not asked_while_starting:  # no answer owed before it was up
                # Counted during updates too: a hung engine would otherwise hold every update
                # (and the lock) until its step timeout, again and again. The built-in engine
                # answers health checks while it loads weights.
                member.missed_checks += 1
                if member.missed_checks >= self.config.max_missed_health_checks:
                    log.warning("engine %s is alive but answered no health check %d times in "
                                "a row: killing it (it is restarted)", member.url,
                                member.missed_checks)
                    member.missed_checks = 0
                    await asyncio.to_thread(process.stop, member.proc, 1.0)
            return
        member.missed_checks = 0
        if member.state == "unreachable":
            try:
                version: str | None = await self.client.weight_version(member.url)
            except Unavailable:
                version = None
            member.state = "ready" if version == str(self.current_version) else "awaiting_weights"
            log.info("engine %s is reachable again (weight version %s)", member.url, version)

    async def _load(self, url: str) -> list[dict[str, Any]] | None:
        """The engine's load per dp rank; None when it is up (/health answers) but serves no
        load route (the router reports that engine as having no load signal). Unavailable
        when it does not answer."""
        try:
            return [rank.view() for rank in await self.client.load(url)]
        except EngineCallError as exc:
            if exc.status in (404, 405) and await self.client.healthy(url):
                return None
            raise

    async def _restart(self, member: EngineMember) -> None:
        code = member.proc.returncode if member.proc else None
        log.warning("engine %s exited with %s; restarting", member.url, code)
        member.state, member.error, member.in_group = "dead", f"exited with {code}", False
        if member.registered:
            member.registered = False
            try:
                await self.router.deregister(member.url)
            except Unavailable as exc:
                log.warning("deregistering %s: %s", member.url, exc)
        member.restarts += 1
        async with self.lock:  # not in the middle of a weight update
            self._spawn(member)
        try:
            await self._bring_up(member)
        except Unavailable as exc:  # the router is away: the next weight update registers it
            member.state, member.error = "awaiting_weights", str(exc)

    # -- for the weight-update coordinator ---------------------------------------------
    async def update_members(self) -> list[EngineMember]:
        """Engines that can take part in a weight update now. One that missed its last health
        check is asked once more: a busy host can delay one answer past its timeout, and an
        engine left out keeps the old weights until the next update. One that still does not
        answer may be hung: it sits out, so the update does not wait on it."""
        candidates = [m for m in self.members if m.state in ("ready", "awaiting_weights")]
        doubtful = [m for m in candidates if m.missed_checks]
        answers = await asyncio.gather(*(self.client.load(m.url) for m in doubtful),
                                       return_exceptions=True)
        for member, answer in zip(doubtful, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("engine %s sits out this weight update: it answered none of its "
                            "last %d health checks (%s)", member.url, member.missed_checks,
                            answer)
            else:
                member.missed_checks = 0
        return [m for m in candidates if m.missed_checks == 0]

    async def on_committed(self, version: int, synced: list[EngineMember]) -> None:
        """Engines in `synced` hold `version` now; register the ones waiting for it."""
        self.current_version = version
        for member in synced:
            if member.registered:
                member.state, member.weight_version = "ready", version
            else:
                await self._register(member)

    def state(self) -> list[dict[str, Any]]:
        return [m.view() for m in self.members]
