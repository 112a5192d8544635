"""The trainer service: builds the policy, runs the training loop, reports its state.

`TrainerRuntime` plugs into the shared gRPC/admin bootstrap (services/common/serve.py). The
loop (loop.py) is blocking torch work, so it runs in one background thread; start() returns
at once and readiness follows the loop. Pause and resume take effect between steps; stop
lets the current step finish and checkpoints what was trained. With more than one rank
this process is rank 0: it drives the other ranks (ranks.py, worker.py) step by step and
stops them when the loop ends. With `parallel.launcher = "local"` it starts them itself, as
children on this machine, before building the model; with "external" srun or torchrun started
every rank (rank_env.py) and they meet at MASTER_ADDR:MASTER_PORT. Built by server.py.
A failed weight sync is retried inside the loop; any other failure ends the process (exit 1,
or 2 for a config error) so that its supervisor restarts it and it resumes from its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from dataclasses import asdict
from typing import Any

import grpc

from services.common.config import EventsConfig, GrpcTlsConfig, RedisConfig
from services.common.errors import ConfigError
from services.common.events import EventPublisher
from services.common.grpc_server import GuardedRegistrar
from services.common.service import ServiceRuntime, status_message
from services.trainer.config import TrainerConfig
from services.trainer.eval_follower import EvalFollower
from services.trainer.objective.stats import TrainerStats

log = logging.getLogger(__name__)


class TrainerRuntime(ServiceRuntime):
    """The trainer behind the shared gRPC server and admin app."""

    name = "trainer"

    def __init__(
        self, config: TrainerConfig, redis: RedisConfig, run_name: str, grpc_token: str | None,
        events: EventsConfig | None = None, engine_api_key: str | None = None,
        grpc_tls: GrpcTlsConfig | None = None,
    ) -> None:
        super().__init__()
        self.grpc_tls = grpc_tls
        self.config = config
        self.redis = redis
        self.run_name = run_name
        self.grpc_token = grpc_token
        self.engine_api_key = engine_api_key  # weight_sync.mode = "direct" posts to engines
        self.events = EventPublisher(redis, run_name, "trainer", events or EventsConfig())
        self.stats = TrainerStats()
        self.eval_follower = EvalFollower(redis, run_name, self.stats)
        self.loop: Any = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: list[subprocess.Popen[bytes]] = []
        self._channel: Any = None
        self._weight_sync: Any = None

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        from services._proto.riptide.v1 import common_pb2, trainer_pb2_grpc

        runtime = self

        class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
            async def GetStatus(  # noqa: N802
                self, request: common_pb2.StatusRequest, context: grpc.aio.ServicerContext
            ) -> common_pb2.ServiceStatus:
                return status_message(runtime)

        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(), server)

    async def start(self) -> None:
        self.eval_follower.start()
        self._thread = threading.Thread(target=self._main, name="trainer-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        # The workers are started from this thread: they get SIGTERM when it ends.
        try:
            self.loop = self._build_loop()
            if self.paused:
                self.loop.unpaused.clear()
            self.loop.run(self._stop.is_set)
            if self._channel is not None:
                from services.trainer.ranks import Stop

                self._channel.send(Stop())
                # Leaving at once could close the sockets before a rank read its Stop.
                self._channel.barrier()
        except Exception as exc:  # the thread's end: the process ends too (below)
            log.exception("trainer loop failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.stats.set_phase("failed")
            # A live process whose loop is gone trains nothing and looks up: exit, so the
            # supervisor restarts it and the loop resumes from its checkpoint. A config
            # error exits 2, which supervisors do not restart (a restart cannot fix it).
            self.request_exit(2 if isinstance(exc, ConfigError) else 1,
                              f"the training loop failed: {self.error}")
        finally:
            if self._weight_sync is not None:
                try:  # leave the weight-update group so engines are not left waiting in it
                    self._weight_sync.close()
                except Exception:
                    log.exception("closing the weight sync failed")
            if self._workers:
                from services.trainer.ranks import join_workers

                join_workers(self._workers)
            self.events.close()

    def _build_loop(self) -> Any:
        from services.common.buffer import SampleBuffer
        from services.common.ports import free_port
        from services.trainer.data.data import GroupStream
        from services.trainer.loop import TrainerLoop
        from services.trainer.megatron_policy import RankAddress, build_policy
        from services.trainer.parallel.rank_env import launched_rank
        from services.trainer.ranks import (
            ControlChannel,
            RankedPolicy,
            Step,
            Sync,
            launch_workers,
            service_world_size,
        )
        from services.trainer.weights.checkpoint import Checkpointer
        from services.trainer.weights.weight_sync import build_weight_sync

        c = self.config
        self.stats.set_phase("building")
        address = None
        if c.parallel.launcher == "external":
            me = launched_rank()  # srun/torchrun started the other ranks, maybe on other nodes
            world_size = me.world_size
            address = RankAddress(0, world_size, me.master_addr, me.master_port, me.local_rank)
        else:
            world_size = service_world_size(c)
            if world_size > 1:
                address = RankAddress(0, world_size, "127.0.0.1", free_port())
                self._workers = launch_workers(c, world_size, address.master_port)
        built = build_policy(c, address)
        policy: Any = built.policy
        on_step = None
        if world_size > 1:
            channel = self._channel = ControlChannel()
            policy = RankedPolicy(built.policy, channel)
            on_step = lambda batch: channel.send(Step(batch.micro_batches))  # noqa: E731
        stream = GroupStream(
            SampleBuffer(self.redis, self.run_name), c.consumer_name, c.rollout_batch_size,
            c.loss.normalize_advantage_std, c.max_tokens_per_microbatch, c.read_block_ms,
            c.pad_token_id, c.packed_sequences, c.shared_prefix,
        )  # fmt: skip
        weight_sync = self._weight_sync = build_weight_sync(
            c.weight_sync, built.backend, self.grpc_token, self.engine_api_key, self.grpc_tls
        )
        sync = None
        if weight_sync is not None:

            def sync(version: int) -> Any:
                if self._channel is not None:
                    self._channel.send(Sync(version))  # the other ranks join the gathers
                return weight_sync.sync(built.model, built.shape, version)

        if c.weight_sync.release_engines_during_step and weight_sync is not None:
            on_step = _releasing_engines(weight_sync, on_step)
        checkpointer = Checkpointer(c.checkpoint.dir, c.checkpoint.num_kept)
        loop: Any = None
        needs_weights = None
        asker = getattr(weight_sync, "needs_weights", None)  # only the rollout-driven sync
        if asker is not None:
            needs_weights = lambda: asker(loop.state.weight_version)  # noqa: E731
        loop = TrainerLoop(
            c, policy, stream, checkpointer, sync, built.reference, stats=self.stats,
            on_step=on_step, shard=built.shard, device=built.device,
            needs_weights=needs_weights, events=self.events,
        )  # fmt: skip
        return loop

    def ready(self) -> bool:
        return self.error is None and self.stats.phase not in ("starting", "building", "failed")

    def lifecycle(self) -> str:
        """`degraded` while a failed weight sync is being retried (the loop is alive and
        trains nothing until it lands); otherwise as every service."""
        if self.stats.phase == "degraded" and not self.paused:
            return "degraded"
        return super().lifecycle()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.eval_follower.stop)

    async def pause(self) -> None:
        await super().pause()
        if self.loop is not None:
            self.loop.unpaused.clear()

    async def resume(self) -> None:
        await super().resume()
        if self.loop is not None:
            self.loop.unpaused.set()

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error, **self.stats.snapshot()}
        if self.loop is not None:
            s = self.loop.state
            out.update(
                step=s.step,
                weight_version=s.weight_version,
                num_groups_trained=len(s.trained_group_ids),
                num_groups_dropped=len(s.dropped_groups),
                num_unacked_entries=len(s.unacked_entry_ids),
                recovery=asdict(self.loop.recovery) if self.loop.recovery else None,
            )
        return out


def _releasing_engines(weight_sync: Any, then: Any) -> Any:
    """An on_step hook that first has the engines free their memory (colocated mode)."""
    release = weight_sync.release_engines

    def on_step(batch: Any) -> None:
        release()
        if then is not None:
            then(batch)

    return on_step
