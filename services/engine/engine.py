"""The engine: one model, one scheduler per dp rank, and the loop thread that drives them.

HTTP handlers never touch scheduler state directly: they hand closures to `call`, which the
loop thread runs between forward steps. Results flow back through each request's `emit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from services.common.errors import InvalidRequest
from services.engine.config import EngineConfig
from services.engine.memory_occupation import MemoryOccupation
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import ModelRunner
from services.engine.random_stream import RandomStream
from services.engine.request import GenRequest
from services.engine.scheduler import Scheduler
from services.engine.shared_tensors import SharedTensorCache, WeightCopy

log = logging.getLogger(__name__)
T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


class Engine:
    """Owns the model runner and the dp-rank schedulers; all their state lives on one thread."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(config)
        self.model_name = config.served_model_name or str(config.model_path)
        self.metrics = EngineMetrics(self.model_name)
        self._version = [config.weight_version]
        self.schedulers = [
            Scheduler(rank, self.runner, config, self.metrics, self._version)
            for rank in range(config.dp_size)
        ]
        self.memory = MemoryOccupation(self.runner, self.schedulers)
        self.shared_tensors = SharedTensorCache()  # weight_routes.py's, under its update lock
        self.paused_mode: str | None = None
        self.block_admission = False
        self._rng = random.Random(config.random_seed)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._rate_at = time.perf_counter()
        self._rate_tokens = [0] * config.dp_size
        self.gen_throughput = [0.0] * config.dp_size
        for rank in range(config.dp_size):
            self.metrics.set_rank(rank, max_total_num_tokens=config.max_total_num_tokens,
                                  num_grammar_queue_reqs=0, num_running_reqs_offline_batch=0,
                                  engine_startup_time=time.perf_counter() - started)

    @property
    def weight_version(self) -> str:
        return self._version[0]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        usage = self.memory.usage()
        log.info("memory: weights %.2f GiB, KV slots %.2f GiB%s", usage["weights_bytes"] / 2**30,
                 usage["kv_cache_bytes"] / 2**30,
                 f", CUDA reserved {usage['cuda_reserved_bytes'] / 2**30:.2f} GiB"
                 if "cuda_reserved_bytes" in usage else "")
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the loop thread between steps; the future holds its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    # ---- called on the loop thread -------------------------------------------------------

    def submit(self, req: GenRequest) -> None:
        if req.dp_rank is None:
            req.dp_rank = min(self.schedulers, key=lambda s: s.load()["num_reqs"]).dp_rank
        elif not 0 <= req.dp_rank < len(self.schedulers):
            raise InvalidRequest(
                f"routed_dp_rank {req.dp_rank} out of range: dp_size is {len(self.schedulers)}"
            )
        seed = req.params.sampling_seed
        req.generator = RandomStream(seed if seed is not None else self._rng.getrandbits(63))
        self.schedulers[req.dp_rank].waiting.append(req)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            for sched in self.schedulers:
                sched.abort(lambda _: True, "paused with mode abort")
        elif mode == "retract":
            for sched in self.schedulers:
                sched.retract()
        self.paused_mode = mode

    def resume(self) -> None:
        self.paused_mode = None

    def abort(self, rids: set[str] | None, message: str = "aborted") -> int:
        """Abort the requests with these ids (every request when None)."""
        return self.abort_where(lambda req: rids is None or req.rid in rids, message)

    def abort_where(self, hit: Callable[[GenRequest], bool], message: str) -> int:
        return sum(sched.abort(hit, message) for sched in self.schedulers)

    def flush_cache(self) -> bool:
        if any(s.running or s.waiting for s in self.schedulers):
            return False
        return all(s.flush_cache() for s in self.schedulers)

    def num_running(self) -> int:
        return sum(len(s.running) for s in self.schedulers)

    def load_weights(self, copy: WeightCopy, flush_cache: bool, version: str | None) -> None:
        started = time.perf_counter()
        self.runner.load_weights(copy)
        for rank in range(self.config.dp_size):
            self.metrics.set_rank(rank, engine_load_weights_time=time.perf_counter() - started)
        if flush_cache:
            for sched in self.schedulers:
                sched.cache.flush()
        if version is not None:
            self._version[0] = version

    def set_weight_version(self, version: str) -> None:
        self._version[0] = version

    # ---- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self.config.num_threads)  # OpenMP settings are per thread
        while not self._stopping.is_set():
            self._run_commands()
            busy = False
            if self.paused_mode is None and not self.memory.released:
                for sched in self.schedulers:
                    busy |= self._step(sched)
            self._publish_gauges()
            if not busy:
                try:
                    command = self._commands.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._execute(*command)

    def _step(self, sched: Scheduler) -> bool:
        try:
            return sched.step(admit=not self.block_admission)
        except Exception as exc:  # a failed forward must not leave requests hanging
            log.exception("dp rank %d step failed", sched.dp_rank)
            sched.retract()
            sched.abort(lambda _: True, f"engine error: {type(exc).__name__}: {exc}")
            return False

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._execute(*command)

    @staticmethod
    def _execute(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the awaiting caller
            future.set_exception(exc)

    def _publish_gauges(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._rate_at
        if elapsed < 0.5:
            return
        self._rate_at = now
        capacity = self.config.max_total_num_tokens
        for sched in self.schedulers:
            rank = sched.dp_rank
            produced = sched.num_generated - self._rate_tokens[rank]
            self._rate_tokens[rank] = sched.num_generated
            self.gen_throughput[rank] = produced / elapsed
            self.metrics.set_rank(
                rank,
                num_running_reqs=len(sched.running),
                num_queue_reqs=len(sched.waiting),
                num_used_tokens=sched.num_used_tokens,
                token_usage=sched.num_used_tokens / capacity,
                utilization=sched.num_used_tokens / capacity,
                num_paused_reqs=len(sched.running) if self.paused_mode == "in_place" else 0,
                gen_throughput=self.gen_throughput[rank],
                num_retracted_reqs=sum(1 for r in sched.waiting if r.num_retractions),
            )

    def server_state(self) -> list[dict[str, Any]]:
        return [
            {
                **sched.load(),
                "num_running_reqs": len(sched.running),
                "prefix_cache_num_tokens": sched.cache.num_tokens,
                "num_generated_tokens": sched.num_generated,
                "last_gen_throughput": self.gen_throughput[sched.dp_rank],
            }
            for sched in self.schedulers
        ]
