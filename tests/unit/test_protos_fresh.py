"""The committed gRPC stubs must match what the protos generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh() -> None:
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_and_carry_the_contract() -> None:
    from services._proto.riptide.v1 import common_pb2, rollout_pb2, router_pb2, sandbox_pb2

    traj = common_pb2.Trajectory(sample_id="s", response_ids=[1, 2], loss_mask=[1, 0],
                                 rollout_logprobs=[-0.5, 0.0], weight_versions=[3, -1],
                                 status=common_pb2.VERDICT_STATUS_NO_VERDICT)
    group = common_pb2.Group(group_id="g", samples=[traj])
    assert common_pb2.Group.FromString(group.SerializeToString()) == group
    assert router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    episode = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].methods_by_name["RunEpisode"]
    assert episode.server_streaming
    update = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].methods_by_name["UpdateWeights"]
    assert update.client_streaming and update.server_streaming
