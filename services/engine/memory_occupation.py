"""Releasing and resuming the engine's memory, as SGLang's `/release_memory_occupation` and
`/resume_memory_occupation` do for colocated training (the trainer steps on the same GPU).

Tags, as SGLang names them: `kv_cache` (the KV slots and the prefix cache), `weights` (the
buffers every parameter is a view of, flat_weights.py; their contents are lost, as in SGLang
without a CPU backup: the trainer pushes new weights after resuming), `cuda_graph` (the
captured decode graphs). No tags means all three. Releasing first retracts the running requests
to the front of their queue (their KV is recomputed later); while anything is released the
engine loop takes no step, so new requests wait in the queue instead of failing. The memory is
really freed (tensors dropped, the CUDA caching allocator emptied), so buffers move: graphs
captured on the old addresses are dropped on any release and captured again once everything is
resident.

Runs on the engine loop thread (`Engine.run`), like everything that touches schedulers.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from services.common.errors import Conflict, InvalidRequest
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import Scheduler

log = logging.getLogger(__name__)
TAGS = ("kv_cache", "weights", "cuda_graph")


def parse_tags(tags: Any) -> list[str]:
    """The tags of a request (None or empty: all); InvalidRequest naming an unknown one."""
    if tags is None or tags == []:
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequest("tags must be a list of strings")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise InvalidRequest(f"unknown memory tag(s) {unknown} (known: {', '.join(TAGS)})")
    return list(dict.fromkeys(tags))


class MemoryOccupation:
    """Which of the engine's memory regions are released, and moving them in and out."""

    def __init__(self, runner: ModelRunner, schedulers: list[Scheduler]) -> None:
        self.runner = runner
        self.schedulers = schedulers
        self.released: set[str] = set()

    @property
    def weights_resident(self) -> bool:
        return "weights" not in self.released

    def release(self, tags: list[str]) -> dict[str, Any]:
        """Free the regions of `tags`; returns what was freed (bytes measured on CUDA)."""
        before = self._allocated()
        retracted = sum(sched.retract() for sched in self.schedulers)
        for sched in self.schedulers:
            _drop_graphs(sched)
        if "kv_cache" in tags and "kv_cache" not in self.released:
            for sched in self.schedulers:
                sched.cache.flush()
                free = getattr(sched.batch, "free_memory", None)
                if free is not None:
                    free()
        if "weights" in tags and "weights" not in self.released:
            self._free_weights()
        self.released |= set(tags) | {"cuda_graph"}  # graphs never outlive a release
        if torch.cuda.is_available() and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
        freed = before - self._allocated()
        log.info("released %s: %.2f GiB freed, %d requests retracted", sorted(tags),
                 freed / 2**30, retracted)
        return {"released": sorted(self.released), "freed_bytes": freed,
                "num_retracted_reqs": retracted}

    def resume(self, tags: list[str]) -> dict[str, Any]:
        """Allocate the regions of `tags` again; graphs are captured once all is resident."""
        before = self._allocated()
        if "weights" in tags and "weights" in self.released:
            self.runner.flat_weights.resume()
        if "kv_cache" in tags and "kv_cache" in self.released:
            for sched in self.schedulers:
                restore = getattr(sched.batch, "restore_memory", None)
                if restore is not None:
                    restore()
        self.released -= set(tags)
        capture_s = 0.0
        if self.released == {"cuda_graph"} or (not self.released):
            started = time.perf_counter()
            for sched in self.schedulers:
                capture = getattr(sched.batch, "capture_graphs", None)
                if capture is not None:
                    capture()
            self.released.clear()
            capture_s = time.perf_counter() - started
        allocated = self._allocated() - before
        log.info("resumed %s (%.2f GiB allocated, graphs captured in %.2f s); still released: "
                 "%s", sorted(tags), allocated / 2**30, capture_s, sorted(self.released))
        return {"released": sorted(self.released), "allocated_bytes": allocated,
                "graph_capture_s": round(capture_s, 3)}

    def usage(self) -> dict[str, int]:
        """The engine's memory split: its weights, its preallocated KV slots and, on CUDA, what
        its allocator holds in all (graph pools and activations included)."""
        split = {
            "weights_bytes": sum(p.numel() * p.element_size()
                                 for p in self.runner.model.parameters()),
            "kv_cache_bytes": sum(getattr(getattr(s.batch, "kv", None), "num_bytes", 0)
                                  for s in self.schedulers),
        }
        if self.runner.device.type == "cuda":
            split["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(self.runner.device))
            split["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved(self.runner.device))
        return split

    def check_weights_resident(self) -> None:
        if not self.weights_resident:
            raise Conflict("the weights are released: POST /resume_memory_occupation with tag "
                           "weights before updating them")

    def _free_weights(self) -> None:
        self.runner.flat_weights.release()

    def _allocated(self) -> int:
        """Bytes the engine holds: CUDA's allocator count, or on CPU the sizes of the
        parameters and KV slots (what a release frees there)."""
        if self.runner.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.runner.device))
        total = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        for sched in self.schedulers:
            kv = getattr(sched.batch, "kv", None)
            total += kv.num_bytes if kv is not None else 0
        return total


def _drop_graphs(sched: Scheduler) -> None:
    drop = getattr(sched.batch, "drop_graphs", None)
    if drop is not None:
        drop()
