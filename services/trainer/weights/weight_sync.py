"""Push the trainer's weights to the engines: Hugging Face-named full tensors, bucket by bucket.

Every trainer rank calls `sync(model, shape, weight_version)`: all ranks drive the gathers of
convert.iter_hf_buckets; only global rank 0 talks to the engines and broadcasts, as rank 0
of a weight-update group the engines join at `rank_offset` (SGLang's protocol,
`/init_weights_update_group` and `/update_weights_from_distributed`). A failure is raised
on rank 0 only, after it has finished the gathers the other ranks are in.

Two ways to reach the engines:
- `RolloutWeightSync` (production): the trainer drives the rollout service's
  `Rollout.UpdateWeights` stream (Begin -> group [-> Joining] -> Bucket... -> bucket_loaded
  -> Commit -> committed) and the rollout service forwards each bucket's metadata to every
  engine.
- `DirectEngineWeightSync` (tests, one node without a rollout service): the trainer posts the
  engines' HTTP endpoints itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from services.common.config import GrpcTlsConfig
from services.common.engine_contract import SERVER_INFO, bearer
from services.common.errors import Conflict, Unavailable
from services.trainer.model.model import ModelShape
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.convert import iter_hf_buckets
from services.trainer.weights.weight_broadcast import Bucket, TrainerEnd, Watch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSyncReport:
    """What one weight update moved and how long it took (zeros on non-zero ranks)."""

    weight_version: int
    num_buckets: int
    num_tensors: int
    num_bytes: int
    duration_s: float
    #: (unix start, unix end, bytes) of each bucket's broadcast, for the events stream.
    bucket_spans: tuple[tuple[float, float, int], ...] = ()


class WeightSync(Protocol):
    """Sends the current weights to the engines; every trainer rank calls `sync`."""

    def sync(self, model: Any, shape: ModelShape, weight_version: int) -> WeightSyncReport: ...

    def close(self) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the wire names it: bfloat16, float32, ..."""
    return str(dtype).removeprefix("torch.")


def bucket_specs(bucket: Bucket) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtype names and shapes of a bucket, in broadcast order."""
    return (
        [name for name, _ in bucket],
        [dtype_name(t.dtype) for _, t in bucket],
        [list(t.shape) for _, t in bucket],
    )


def _with_last(buckets: Iterator[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Each bucket and whether it is the last (looks one bucket ahead)."""
    current = next(buckets, None)
    while current is not None:
        following = next(buckets, None)
        yield current, following is None
        current = following


class _SyncBase:
    def __init__(self, config: WeightSyncConfig, backend: str) -> None:
        self.config = config
        self.dtype = getattr(torch, config.dtype)
        self.end = TrainerEnd(config, backend)
        self._bucket_spans: list[tuple[float, float, int]] = []

    def _bucket_sent(self, began: float, bucket: Bucket) -> tuple[int, int]:
        """Count a broadcast bucket and note its span; its tensors and bytes."""
        n, size = _count(bucket)
        self._bucket_spans.append((began, time.time(), size))
        return n, size

    def sync(self, model: Any, shape: ModelShape, weight_version: int) -> WeightSyncReport:
        start = time.monotonic()
        buckets = iter_hf_buckets(model, shape, self.config.bucket_size_mb, self.dtype)
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in buckets:  # gathers only
                pass
            return WeightSyncReport(weight_version, 0, 0, 0, time.monotonic() - start)
        self._bucket_spans = []
        try:
            counts = self._send(_with_last(buckets), weight_version)
        finally:
            for _ in buckets:  # finish the gathers the other ranks are in, even on failure
                pass
        report = WeightSyncReport(weight_version, *counts, time.monotonic() - start,
                                  tuple(self._bucket_spans))
        log.info("weight sync v%d: %d buckets, %d tensors, %.1f MB in %.2fs", weight_version,
                 report.num_buckets, report.num_tensors, report.num_bytes / 2**20,
                 report.duration_s)
        return report

    def _send(self, buckets: Iterator[tuple[Bucket, bool]], version: int) -> tuple[int, int, int]:
        raise NotImplementedError


def _count(bucket: Bucket) -> tuple[int, int]:
    return len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)


class DirectEngineWeightSync(_SyncBase):
    """Rank 0 posts SGLang's weight-update endpoints of every engine itself."""

    def __init__(self, config: WeightSyncConfig, backend: str,
                 api_key: str | None = None) -> None:
        super().__init__(config, backend)
        import httpx

        self.urls = [u.rstrip("/") for u in config.engine_urls]
        self.http = httpx.Client(timeout=config.timeout_s, headers=bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))
        self.engine_group: str | None = None

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.http.post(f"{url}{path}", json=body)
        data: dict[str, Any] = reply.json() if reply.content else {}
        if reply.status_code != 200 or data.get("success") is False:
            raise Unavailable(f"{url}{path} answered {reply.status_code}: {reply.text[:500]}")
        return data

    def _post_all(self, path: str, bodies: list[dict[str, Any]]) -> list[Future[dict[str, Any]]]:
        return [self.pool.submit(self._post, u, path, b) for u, b in zip(self.urls, bodies,
                                                                          strict=True)]

    def _engine_tp_sizes(self) -> list[int]:
        sizes = []
        for url in self.urls:
            for path in SERVER_INFO:  # SGLang 0.5.23's route first, the deprecated one after
                reply = self.http.get(f"{url}{path}")
                if reply.status_code not in (404, 405):
                    break
            if reply.status_code != 200:
                raise Unavailable(f"{url}{path} answered {reply.status_code}: {reply.text[:500]}")
            sizes.append(int(reply.json().get("tp_size", 1)))
        return sizes

    def _join(self) -> None:
        sizes = self._engine_tp_sizes()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world_size = 1 + sum(sizes)
        body = dict(master_address=self.config.master_address, master_port=self.end.port,
                    world_size=world_size, group_name=self.end.group_name,
                    backend=self.end.backend)
        if self.engine_group is not None:  # left over from an abandoned update
            self._destroy_engine_group()
        self.engine_group = self.end.group_name
        futures = self._post_all("/init_weights_update_group",
                                 [dict(body, rank_offset=o) for o in offsets])
        self.end.join(world_size, Watch(calls=futures))
        for future in futures:
            future.result()

    def _send(self, buckets: Iterator[tuple[Bucket, bool]], version: int) -> tuple[int, int, int]:
        if self.end.group is None:
            self._join()
        num_buckets = num_tensors = num_bytes = 0
        for bucket, last in buckets:
            names, dtypes, shapes = bucket_specs(bucket)
            body = dict(names=names, dtypes=dtypes, shapes=shapes,
                        group_name=self.end.group_name, flush_cache=last,
                        weight_version=str(version) if last else None)
            began = time.time()
            futures = self._post_all("/update_weights_from_distributed", [body] * len(self.urls))
            self.end.broadcast(bucket, Watch(calls=futures))
            for future in futures:
                future.result()
            n, size = self._bucket_sent(began, bucket)
            num_buckets, num_tensors, num_bytes = num_buckets + 1, num_tensors + n, num_bytes + size
        return num_buckets, num_tensors, num_bytes

    def _destroy_engine_group(self) -> None:
        futures = self._post_all("/destroy_weights_update_group",
                                 [{"group_name": self.engine_group}] * len(self.urls))
        for future in futures:
            future.exception()  # an engine that never joined refuses: fine
        self.engine_group = None

    def close(self) -> None:
        # Both ends leave at once: over NCCL an engine's destroy waits for the trainer's.
        futures = []
        if self.engine_group is not None:
            futures = self._post_all("/destroy_weights_update_group",
                                     [{"group_name": self.engine_group}] * len(self.urls))
            self.engine_group = None
        self.end.leave()
        for future in futures:
            future.exception(timeout=self.config.timeout_s)  # a refusal is fine: we are leaving
        self.pool.shutdown()
        self.http.close()


class RolloutWeightSync(_SyncBase):
    """Rank 0 drives the rollout service's `Rollout.UpdateWeights` stream and broadcasts;
    the rollout service pauses the engines and forwards each bucket's metadata to them."""

    def __init__(self, config: WeightSyncConfig, backend: str, token: str | None = None,
                 tls: GrpcTlsConfig | None = None) -> None:
        super().__init__(config, backend)
        from services._proto.riptide.v1 import rollout_pb2_grpc
        from services.common.grpc_client import sync_channel

        self.channel = sync_channel(config.rollout_address, token, tls=tls)
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self._shares: Any = None  # colocated: BucketShares, made on the first bucket

    def _shared(self, bucket: Bucket) -> str:
        """Colocated: the bucket's payload (the engines may read it until they answer)."""
        if self._shares is None:
            from services.trainer.weights.bucket_shares import BucketShares

            self._shares = BucketShares(self.dtype)
        payload: str = self._shares.share(bucket)[0]
        return payload

    def _send(self, buckets: Iterator[tuple[Bucket, bool]], version: int) -> tuple[int, int, int]:
        import queue

        requests: queue.Queue[Any] = queue.Queue()
        events = self.stub.UpdateWeights(iter(requests.get, None), timeout=self.config.timeout_s)
        # Completes when the stream ends: mid-update that means the rollout side failed.
        ended: Future[str] = Future()
        events.add_done_callback(
            lambda call: ended.set_result(f"{call.code().name}: {call.details()}"))
        watch = Watch(stream_end=ended)

        def expect(kind: str) -> Any:
            event = next(events, None)
            if event is None or event.WhichOneof("event") != kind:
                raise Conflict(f"weight update v{version}: expected {kind} from rollout, got "
                               f"{event.WhichOneof('event') if event is not None else 'end'}")
            return getattr(event, kind)

        try:
            return self._stream(requests, expect, watch, buckets, version)
        except BaseException:
            events.cancel()
            self.end.reset()  # the next try forms the weight-update group afresh
            raise
        finally:
            requests.put(None)

    def _stream(self, requests: Any, expect: Any, watch: Watch,
                buckets: Iterator[tuple[Bucket, bool]], version: int) -> tuple[int, int, int]:
        from services._proto.riptide.v1 import rollout_pb2 as pb

        colocated = self.config.mode == "colocated"  # IPC payloads in the buckets, no group
        requests.put(pb.WeightUpdateRequest(begin=pb.WeightUpdateBegin(
            weight_version=version, master_address=self.config.master_address,
            master_port=self.end.port, group_name=self.end.group_name,
            backend=self.end.backend, colocated=colocated)))
        group = expect("group")
        if colocated:
            pass
        elif group.trainer_must_join:
            self.end.leave()  # its rendezvous store closes before any engine looks there
            requests.put(pb.WeightUpdateRequest(joining=pb.WeightUpdateJoining()))
            self.end.join(group.world_size, watch)
        elif self.end.group is None:
            raise Conflict("rollout says the weight-update group exists, but this trainer "
                           "never joined it; the next update forms it again")
        num_buckets = num_tensors = num_bytes = 0
        for index, (bucket, _) in enumerate(buckets):
            names, dtypes, shapes = bucket_specs(bucket)
            specs = [pb.TensorSpec(name=n, dtype=d, shape=s)
                     for n, d, s in zip(names, dtypes, shapes, strict=True)]
            began = time.time()
            if colocated:
                payload = self._shared(bucket)
                requests.put(pb.WeightUpdateRequest(bucket=pb.WeightBucket(
                    bucket_index=index, tensors=specs, serialized_named_tensors=payload)))
            else:
                requests.put(pb.WeightUpdateRequest(
                    bucket=pb.WeightBucket(bucket_index=index, tensors=specs)))
                self.end.broadcast(bucket, watch)
            loaded = expect("bucket_loaded")
            if loaded != index:
                raise Conflict(f"rollout loaded bucket {loaded}, expected {index}")
            n, size = self._bucket_sent(began, bucket)
            num_buckets, num_tensors, num_bytes = (num_buckets + 1, num_tensors + n,
                                                   num_bytes + size)
        requests.put(pb.WeightUpdateRequest(commit=pb.WeightUpdateCommit()))
        committed = expect("committed")
        if committed != version:
            raise Conflict(f"rollout committed v{committed}, expected v{version}")
        return num_buckets, num_tensors, num_bytes

    def release_engines(self) -> None:
        """Colocated mode, before a trainer step: the rollout service's engines free their
        memory; the next update resumes it."""
        from services._proto.riptide.v1 import rollout_pb2 as pb

        self.stub.ReleaseEngineMemory(pb.ReleaseEngineMemoryRequest(),
                                      timeout=self.config.timeout_s)

    def needs_weights(self, version: int) -> bool:
        """Whether the rollout service's engines lack weight version `version` (it restarted,
        or an engine came back with its initial weights and waits for an update)."""
        import json

        from google.protobuf import json_format

        from services._proto.riptide.v1 import common_pb2

        status = self.stub.GetStatus(common_pb2.StatusRequest(), timeout=10.0)
        details = json.loads(json_format.MessageToJson(status.details))
        held = details.get("weight_version")
        return bool(details.get("needs_weights")) or (held is not None and held < version)

    def close(self) -> None:
        self.end.leave()
        self.channel.close()


def build_weight_sync(
    config: WeightSyncConfig, backend: str, token: str | None = None,
    engine_api_key: str | None = None, tls: GrpcTlsConfig | None = None,
) -> WeightSync | None:
    """The weight sync the config asks for (None when mode is off)."""
    if config.mode == "off":
        return None
    if config.mode == "direct":
        return DirectEngineWeightSync(config, backend, engine_api_key)
    if config.mode == "colocated_direct":
        from services.trainer.weights.weight_ipc import ColocatedWeightSync

        return ColocatedWeightSync(config, engine_api_key)
    return RolloutWeightSync(config, backend, token, tls)
