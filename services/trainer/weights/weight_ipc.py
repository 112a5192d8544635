"""Colocated weight sync: the trainer hands its tensors to engines on the same GPU (or the same
host) through CUDA IPC handles, with no collective group.

Per bucket (`bucket_mb`), `ColocatedWeightSender` pickles the trainer's gathered, Hugging
Face-named tensors of the engine dtype with torch's multiprocessing reductions
(`tensor_payload.encode`: a CUDA tensor becomes an IPC handle of its allocation, opened once
per allocation by the engine), POSTs them to every engine's `/update_weights_from_tensor`
(SGLang's contract, load_format None), waits for every answer, then drops the bucket. CUDA
tensors of the engine dtype go as they are (the engine's copy into its parameters is the only
copy); others (another dtype, not contiguous, or on CPU) are first copied into one flat buffer
of the engine dtype, so the extra memory is at most one bucket. On CPU the buffer is shared as
a shared-memory file (torch's file_system strategy) and the path is otherwise the same.

It also drives SGLang's `/release_memory_occupation` and `/resume_memory_occupation`, which
colocated mode calls around the trainer's step. `ColocatedWeightSync` is the trainer's
`WeightSync` for `weight_sync.mode = "colocated_direct"` (engines at known URLs, no rollout
service): rank 0 sends, the other ranks only drive the gathers (weights/weight_sync.py's protocol).
`weight_sync.mode = "colocated"` goes through the rollout service instead
(`RolloutWeightSync`, which puts `share_bucket`'s payload into each WeightBucket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
import torch.distributed as dist

from services.common.engine_contract import bearer
from services.common.errors import Unavailable
from services.common.tensor_payload import encode, pack
from services.trainer.model.model import ModelShape
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.convert import iter_hf_buckets
from services.trainer.weights.weight_sync import WeightSyncReport

log = logging.getLogger(__name__)
Bucket = list[tuple[str, torch.Tensor]]


def share_bucket(bucket: Bucket, dtype: torch.dtype, pack_always: bool = False
                 ) -> tuple[str, Bucket]:
    """The bucket's payload and the tensors it shares (keep them until the engines answer):
    CUDA tensors of `dtype` as they are, anything else packed into one flat buffer."""
    as_is = not pack_always and all(
        t.device.type == "cuda" and t.dtype == dtype and t.is_contiguous() for _, t in bucket)
    views = bucket if as_is else pack(bucket, dtype)[1]
    return encode(views), views


class ColocatedWeightSender:
    """Posts shared tensors (and memory release/resume) to a set of engines."""

    def __init__(self, engine_urls: list[str], dtype: torch.dtype, timeout_s: float,
                 api_key: str | None = None, pack_always: bool = False) -> None:
        """`pack_always`: copy every bucket into one buffer even when its tensors could go as
        they are (one IPC handle per bucket instead of one per allocation)."""
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.dtype = dtype
        self.pack_always = pack_always
        #: seconds of the last send: pickling here, and the engines' opening and loading
        self.timings: dict[str, float] = {}
        self.http = httpx.Client(timeout=timeout_s, headers=bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    def _post_all(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        futures = [self.pool.submit(self._post, url, path, body) for url in self.urls]
        return [future.result() for future in futures]

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.http.post(f"{url}{path}", json=body)
        data: dict[str, Any] = reply.json() if reply.content else {}
        if reply.status_code != 200 or data.get("success") is False:
            raise Unavailable(f"{url}{path} answered {reply.status_code}: {reply.text[:500]}")
        return data

    def send_bucket(self, bucket: Bucket, last: bool, version: str | None) -> int:
        """One bucket to every engine; returns its bytes. The buffer is freed on return."""
        started = time.perf_counter()
        payload, views = share_bucket(bucket, self.dtype, self.pack_always)
        try:
            body = {"serialized_named_tensors": [payload], "flush_cache": last,
                    "weight_version": version if last else None}
            encoded = time.perf_counter()
            answers = self._post_all("/update_weights_from_tensor", body)
            self._count("encode_s", encoded - started)
            self._count("open_s", max(float(a.get("open_s", 0.0)) for a in answers))
            self._count("load_s", max(float(a.get("load_s", 0.0)) for a in answers))
            return sum(t.numel() * t.element_size() for _, t in views)
        finally:
            del views  # every engine has copied: the bucket's memory may go back

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
