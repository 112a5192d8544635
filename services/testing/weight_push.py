"""A stand-in for the trainer's end of `Rollout.UpdateWeights`, for tests of the rollout service.

Speaks the protocol (Begin -> group -> Bucket/broadcast -> bucket_loaded ... -> Commit ->
committed) and, as rank 0 of the weight-update group over gloo, broadcasts the given tensors
by their Hugging Face names. The real trainer does the same in
services/trainer/weights/weight_sync.py.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import torch

from services._proto.riptide.v1 import rollout_pb2 as pb
from services._proto.riptide.v1 import rollout_pb2_grpc
from services.common import weight_group
from services.common.grpc_client import sync_channel
from services.common.ports import free_port


class WeightPusher:
    """Rank 0 of the weight-update group; keeps the group between updates like the trainer."""

    def __init__(self, rollout_address: str, group_name: str = "riptide-test-weights",
                 timeout_s: float = 120.0) -> None:
        self.channel = sync_channel(rollout_address)
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.port = free_port()
        self.group: Any = None
        self.joins = 0

    def push(self, tensors: dict[str, torch.Tensor], version: int, num_buckets: int = 2,
             between_buckets: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one update; returns what the rollout service answered."""
        requests: queue.Queue[Any] = queue.Queue()
        events = self.stub.UpdateWeights(iter(requests.get, None), timeout=self.timeout_s)
        answered: dict[str, Any] = {"buckets": []}
        try:
            requests.put(pb.WeightUpdateRequest(begin=pb.WeightUpdateBegin(
                weight_version=version, master_address="127.0.0.1", master_port=self.port,
                group_name=self.group_name, backend="gloo")))
            group = next(events).group
            answered["world_size"] = group.world_size
            answered["must_join"] = group.trainer_must_join
            if group.trainer_must_join:
                self.close()
                requests.put(pb.WeightUpdateRequest(joining=pb.WeightUpdateJoining()))
                self._join(group.world_size)
            names = list(tensors)
            for index in range(num_buckets):
                chunk = names[index::num_buckets]
                requests.put(pb.WeightUpdateRequest(bucket=pb.WeightBucket(
                    bucket_index=index, tensors=[pb.TensorSpec(
                        name=n, dtype=str(tensors[n].dtype).removeprefix("torch."),
                        shape=list(tensors[n].shape)) for n in chunk])))
                for name in chunk:
                    weight_group.broadcast_tensor(tensors[name].contiguous(), self.group)
                answered["buckets"].append(next(events).bucket_loaded)
                if between_buckets is not None:
                    between_buckets()
            requests.put(pb.WeightUpdateRequest(commit=pb.WeightUpdateCommit()))
            answered["committed"] = next(events).committed
        finally:
            requests.put(None)
        return answered

    def _join(self, world_size: int) -> None:
        self.close()
        self.group = weight_group.init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{self.port}", world_size=world_size,
            rank=0, group_name=self.group_name, timeout_s=self.timeout_s)
        self.joins += 1

    def close(self) -> None:
        if self.group is not None:
            weight_group.destroy_process_group(self.group)
            self.group = None
