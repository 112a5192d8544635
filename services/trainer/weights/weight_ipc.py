"""Colocated weight sync: the trainer hands its tensors to engines on the same GPU (or the same
host) through CUDA IPC handles, with no collective group.

Per bucket (`bucket_mb`), `ColocatedWeightSender` copies the trainer's gathered, Hugging
Face-named tensors into a `StagingBuffer` (one grouped copy into views of one flat buffer of
the engine dtype, allocated once and reused by every bucket of every sync), and POSTs the
bucket's payload to every engine's `/update_weights_from_tensor` (SGLang's contract, load_format
None). The payload (`tensor_payload.encode`: a torch multiprocessing pickle, in which the
buffer is one CUDA IPC handle) is pickled once per bucket layout and re-sent as it is, so an
engine that keeps the handle open loads every later sync without opening or unpickling
anything. The buffer costs the trainer one bucket of memory for as long as the sender lives.
On CPU the buffer is a shared-memory file (torch's file_system strategy) and the path is
otherwise the same.

It also drives SGLang's `/release_memory_occupation` and `/resume_memory_occupation`, which
colocated mode calls around the trainer's step. `ColocatedWeightSync` is the trainer's
`WeightSync` for `weight_sync.mode = "colocated_direct"` (engines at known URLs, no rollout
service): rank 0 sends, the other ranks only drive the gathers (weights/weight_sync.py's protocol).
`weight_sync.mode = "colocated"` goes through the rollout service instead
(`RolloutWeightSync`, which puts a `StagingBuffer`'s payload into each WeightBucket).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from services.common.engine_contract import bearer
from services.common.errors import Unavailable
from services.common.tensor_payload import encode
from services.trainer.model.model import ModelShape
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.convert import iter_hf_buckets
from services.trainer.weights.weight_sync import WeightSyncReport

log = logging.getLogger(__name__)
Bucket = list[tuple[str, torch.Tensor]]
JSON = {"content-type": "application/json"}


class StagingBuffer:
    """One flat buffer of the engine dtype per device, reused by every bucket of every sync,
    and each bucket layout's payload, pickled once: the engines see the same IPC handle and
    the same payload every sync. The buffer grows to the largest bucket (a new handle, so the
    payloads of the old one are dropped)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._payloads: dict[tuple[Any, ...], tuple[str, Bucket]] = {}

    def share(self, bucket: Bucket) -> tuple[str, Bucket]:
        """The bucket copied into the buffer: its payload and the views it names (valid until
        the next `share`)."""
        device = bucket[0][1].device
        layout = (device, tuple((name, tuple(t.shape)) for name, t in bucket))
        cached = self._payloads.get(layout)
        if cached is None:
            cached = self._encode(device, bucket)
            self._payloads[layout] = cached
        payload, views = cached
        # One grouped copy (it casts and gathers strided sources as it goes).
        torch._foreach_copy_([v for _, v in views], [t for _, t in bucket])
        if device.type == "cuda":
            # The engine reads the buffer without waiting on an event of ours.
            torch.cuda.current_stream(device).synchronize()
        return payload, views

    def _encode(self, device: torch.device, bucket: Bucket) -> tuple[str, Bucket]:
        numel = sum(t.numel() for _, t in bucket)
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < numel:
            self._payloads = {k: v for k, v in self._payloads.items() if k[0] != device}
            buffer = torch.empty(numel, dtype=self.dtype, device=device)
            if device.type == "cpu":
                torch_mp.set_sharing_strategy("file_system")
                buffer.share_memory_()
            self._buffers[device] = buffer
        views, start = [], 0
        for name, tensor in bucket:
            views.append((name, buffer[start:start + tensor.numel()].view(tensor.shape)))
            start += tensor.numel()
        return encode(views), views

    @property
    def num_bytes(self) -> int:
        """The memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class ColocatedWeightSender:
    """Posts shared tensors (and memory release/resume) to a set of engines."""

    def __init__(self, engine_urls: list[str], dtype: torch.dtype, timeout_s: float,
                 api_key: str | None = None) -> None:
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.dtype = dtype
        self.staging = StagingBuffer(dtype)
        #: seconds of the last send: staging here (copy, and pickling a new layout), and the
        #: engines' opening (unpickling) and loading
        self.timings: dict[str, float] = {}
        self.http = httpx.Client(timeout=timeout_s, headers=bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    def _post_all(self, path: str, body: dict[str, Any] | bytes) -> list[dict[str, Any]]:
        futures = [self.pool.submit(self._post, url, path, body) for url in self.urls]
        return [future.result() for future in futures]

    def _post(self, url: str, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        if isinstance(body, bytes):
            reply = self.http.post(f"{url}{path}", content=body, headers=JSON)
        else:
            reply = self.http.post(f"{url}{path}", json=body)
        data: dict[str, Any] = reply.json() if reply.content else {}
        if reply.status_code != 200 or data.get("success") is False:
            raise Unavailable(f"{url}{path} answered {reply.status_code}: {reply.text[:500]}")
        return data

    def send_bucket(self, bucket: Bucket, last: bool, version: str | None) -> int:
        """One bucket to every engine; returns its bytes."""
        started = time.perf_counter()
        payload, views = self.staging.share(bucket)
        # The payload is already JSON-safe (base64): no need to serialize it again.
        body = (f'{{"serialized_named_tensors":["{payload}"],"flush_cache":'
                f'{json.dumps(last)},"weight_version":{json.dumps(version if last else None)}}}')
        staged = time.perf_counter()
        answers = self._post_all("/update_weights_from_tensor", body.encode())
        self._count("stage_s", staged - started)
        self._count("open_s", max(float(a.get("open_s", 0.0)) for a in answers))
        self._count("load_s", max(float(a.get("load_s", 0.0)) for a in answers))
        return sum(t.numel() * t.element_size() for _, t in views)

    def _count(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def send(self, buckets: Iterable[Bucket], version: str) -> tuple[int, int, int]:
        """Every bucket in order (the last one flushes caches and sets `version`); returns
        (buckets, tensors, bytes)."""
        num_buckets = num_tensors = num_bytes = 0
        self.timings = {}
        iterator = iter(buckets)
        current = next(iterator, None)
        while current is not None:
            following = next(iterator, None)
            num_bytes += self.send_bucket(current, following is None, version)
            num_buckets, num_tensors = num_buckets + 1, num_tensors + len(current)
            current = following
        return num_buckets, num_tensors, num_bytes

    def release(self, tags: list[str] | None = None) -> list[dict[str, Any]]:
        """Every engine frees the memory of `tags` (None: all); their answers."""
        return self._post_all("/release_memory_occupation", {"tags": tags})

    def resume(self, tags: list[str] | None = None) -> list[dict[str, Any]]:
        return self._post_all("/resume_memory_occupation", {"tags": tags})

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()


class ColocatedWeightSync:
    """The trainer's WeightSync over CUDA IPC: resume the engines' weights, send every
    bucket, resume their KV cache (a no-op for engines that released nothing)."""

    def __init__(self, config: WeightSyncConfig, api_key: str | None = None) -> None:
        self.config = config
        self.dtype = getattr(torch, config.dtype)
        self.sender = ColocatedWeightSender(config.engine_urls, self.dtype, config.timeout_s,
                                            api_key)

    def sync(self, model: Any, shape: ModelShape, weight_version: int) -> WeightSyncReport:
        start = time.monotonic()
        buckets = iter_hf_buckets(model, shape, self.config.bucket_mb, self.dtype)
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in buckets:  # gathers only
                pass
            return WeightSyncReport(weight_version, 0, 0, 0, time.monotonic() - start)
        try:
            self.sender.resume(["weights"])
            counts = self.sender.send(buckets, str(weight_version))
            self.sender.resume(["kv_cache"])
        finally:
            for _ in buckets:  # finish the gathers the other ranks are in, even on failure
                pass
        report = WeightSyncReport(weight_version, *counts, time.monotonic() - start)
        log.info("colocated weight sync v%d: %d buckets, %.1f MB in %.2fs", weight_version,
                 report.num_buckets, report.num_bytes / 2**20, report.duration_s)
        return report

    def release_engines(self) -> None:
        """Before the trainer's step (synchronous colocated mode): engines free everything."""
        self.sender.release(None)

    def close(self) -> None:
        self.sender.close()
