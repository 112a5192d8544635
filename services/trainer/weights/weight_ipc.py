"""Colocated weight sync: the trainer hands its tensors to engines on the same GPU (or the same
host) through CUDA IPC handles, with no collective group.

Per bucket (`bucket_mb`), `ColocatedWeightSender` shares the trainer's gathered, Hugging
Face-named tensors through `BucketShares` (as they are when they are the same live storages
every sync, else copied into one persistent staging buffer) and POSTs the bucket's payload to
every engine's `/update_weights_from_tensor` (SGLang's contract, load_format None). The
payload (`tensor_payload.encode`: a torch multiprocessing pickle of CUDA IPC handles) is
pickled once per bucket layout and re-sent as it is, so an engine that keeps the handles open
loads every later sync without opening or unpickling anything. On CPU the staging buffer is a
shared-memory file (torch's file_system strategy) and the path is otherwise the same.

It also drives SGLang's `/release_memory_occupation` and `/resume_memory_occupation`, which
colocated mode calls around the trainer's step. `ColocatedWeightSync` is the trainer's
`WeightSync` for `weight_sync.mode = "colocated_direct"` (engines at known URLs, no rollout
service): rank 0 sends, the other ranks only drive the gathers (weights/weight_sync.py's protocol).
`weight_sync.mode = "colocated"` goes through the rollout service instead
(`RolloutWeightSync`, which puts a `BucketShares` payload into each WeightBucket).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from services.common.engine_contract import bearer
from services.common.errors import Unavailable
from services.trainer.model.model import ModelShape
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.bucket_shares import Bucket, BucketShares
from services.trainer.weights.convert import iter_hf_buckets
from services.trainer.weights.engine_poster import EnginePoster
from services.trainer.weights.weight_sync import WeightSyncReport

log = logging.getLogger(__name__)


class ColocatedWeightSender:
    """Posts shared tensors (and memory release/resume) to a set of engines."""

    def __init__(self, engine_urls: list[str], dtype: torch.dtype, timeout_s: float,
                 api_key: str | None = None, direct: bool = True) -> None:
        """`direct` False: stage every bucket, also tensors that could go as they are."""
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.dtype = dtype
        self.shares = BucketShares(dtype, direct)
        #: seconds of the last send: sharing here (staging copies, pickling new layouts), the
        #: engines' answers (`post_s`, a round trip to the slowest engine), and in them the
        #: engines' opening (unpickling) and loading
        self.timings: dict[str, float] = {}
        self.http = EnginePoster(timeout_s, bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    def _post_all(self, path: str, body: dict[str, Any] | bytes) -> list[dict[str, Any]]:
        if len(self.urls) == 1:  # no hand-off to a pool thread and back
            return [self._post(self.urls[0], path, body)]
        futures = [self.pool.submit(self._post, url, path, body) for url in self.urls]
        return [future.result() for future in futures]

    def _post(self, url: str, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, content = self.http.post(url, path, raw)
        try:
            data: dict[str, Any] = json.loads(content) if content else {}
        except ValueError:
            data = {}
        if status != 200 or data.get("success") is False:
            text = content[:500].decode(errors="replace")
            raise Unavailable(f"{url}{path} answered {status}: {text}")
        return data

    def send_bucket(self, bucket: Bucket, last: bool, version: str | None) -> int:
        """One bucket to every engine; returns its bytes."""
        started = time.perf_counter()
        payload, views = self.shares.share(bucket)
        # The payload is already JSON-safe (base64): no need to serialize it again.
        body = (f'{{"serialized_named_tensors":["{payload}"],"flush_cache":'
                f'{json.dumps(last)},"weight_version":{json.dumps(version if last else None)}}}')
        shared = time.perf_counter()
        answers = self._post_all("/update_weights_from_tensor", body.encode())
        self._count("share_s", shared - started)
        self._count("post_s", time.perf_counter() - shared)
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
        buckets = iter_hf_buckets(model, shape, self.config.bucket_size_mb, self.dtype)
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
