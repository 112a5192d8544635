"""Sample-buffer throughput: Riptide's SampleBuffer against raw redis-py on the same groups.

Each round moves groups of 16 samples of 8k tokens (prompt and response ids, loss mask,
log-probs, per-token weight versions) through put -> read -> ack, in batches as the trainer
reads them, once through SampleBuffer and once through raw redis-py (XADD, XREADGROUP, XACK
of the same Group's serialized bytes, serialized and parsed with the same protobuf calls).
The sides take turns batch by batch (the order rotates), so a noisy machine slows them
alike; the median round of each side is reported. `raw_bytes` is raw
redis-py moving pre-serialized bytes without the protobuf codec, and `riptide_bytes` the
same through SampleBuffer.put_serialized / read_serialized: `ratio_bytes` is the buffer's
own overhead with the codec taken out.

Usage: python bench/buffer.py [--rounds 9] [--groups 64] [--batch 16]
Last line: {"riptide": {...}, "raw": {...}, "ratio": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from itertools import count
from typing import Any

import numpy as np
import redis

from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group
from services.common.buffer import SampleBuffer
from services.common.redis_connect import connect
from services.testing.redis_server import RedisServer

NUM_SAMPLES = 16
PROMPT_TOKENS = 2048
RESPONSE_TOKENS = 6144
VOCAB = 151_552
RAW_STREAM = "bench:raw"


def make_group(rng: np.random.Generator, index: int) -> Group:
    """A multi-turn agent group: model turns (loss 1) interleaved with observations (loss 0)."""
    group = Group(group_id=f"template-{index}", task_id="tbench/fix-git", min_weight_version=41)
    for sample in range(NUM_SAMPLES):
        mask = np.zeros(RESPONSE_TOKENS, dtype=np.int64)
        cuts = np.sort(rng.choice(RESPONSE_TOKENS, 16, replace=False))
        for start, stop in zip(cuts[0::2], cuts[1::2], strict=True):
            mask[start:stop] = 1
        versions = np.where(mask == 1, np.where(np.arange(RESPONSE_TOKENS) < 3000, 41, 42), -1)
        logprobs = (-rng.exponential(0.7, RESPONSE_TOKENS) * mask).astype(np.float32)
        traj = group.samples.add(
            sample_id=f"template-{index}/{sample}",
            group_id=group.group_id,
            task_id=group.task_id,
            sample_index=sample,
            reward=float(rng.integers(0, 2)),
            status=VERDICT_STATUS_SCORED,
            num_turns=8,
            finish_reason="complete",
        )
        traj.prompt_ids.extend(rng.integers(0, VOCAB, PROMPT_TOKENS).tolist())
        traj.response_ids.extend(rng.integers(0, VOCAB, RESPONSE_TOKENS).tolist())
        traj.loss_mask.extend(mask.tolist())
        traj.rollout_logprobs.extend(logprobs.tolist())
        traj.weight_versions.extend(versions.tolist())
        traj.timings.generate_s = 41.5
    return group


def riptide_batch(buffer: SampleBuffer, groups: list[Group], ids: count) -> None:
    for group in groups:
        group.group_id = f"g{next(ids)}"
        buffer.put(group)
    entries = buffer.read("bench", count=len(groups))
    assert len(entries) == len(groups)
    buffer.ack([entry_id for entry_id, _ in entries])


def raw_batch(client: redis.Redis, groups: list[Group], ids: count) -> None:
    for group in groups:
        group.group_id = f"g{next(ids)}"
        client.xadd(RAW_STREAM, {"group": group.SerializeToString()})
    reply: Any = client.xreadgroup("trainer", "bench", {RAW_STREAM: ">"}, count=len(groups))
    ((_, entries),) = reply
    parsed = [Group.FromString(fields[b"group"]) for _, fields in entries]
    assert len(parsed) == len(groups)
    client.xack(RAW_STREAM, "trainer", *[entry_id for entry_id, _ in entries])


def riptide_bytes_batch(buffer: SampleBuffer, payloads: list[bytes], ids: count) -> None:
    for payload in payloads:
        buffer.put_serialized(f"b{next(ids)}", payload)
    entries = buffer.read_serialized("bench", count=len(payloads))
    assert len(entries) == len(payloads)
    buffer.ack([entry_id for entry_id, _ in entries])


def raw_bytes_batch(client: redis.Redis, payloads: list[bytes]) -> None:
    for payload in payloads:
        client.xadd(RAW_STREAM, {"group": payload})
    reply: Any = client.xreadgroup("trainer", "bench", {RAW_STREAM: ">"}, count=len(payloads))
    ((_, entries),) = reply
    assert len(entries) == len(payloads)
    client.xack(RAW_STREAM, "trainer", *[entry_id for entry_id, _ in entries])


def timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--groups", type=int, default=64, help="groups per round and side")
    parser.add_argument("--batch", type=int, default=16, help="groups per read")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    templates = [make_group(rng, i) for i in range(8)]
    groups = [templates[i % len(templates)] for i in range(args.groups)]
    payloads = [group.SerializeToString() for group in groups]
    group_mb = statistics.mean(len(p) for p in payloads) / 1e6
    print(f"group: {NUM_SAMPLES} samples x {PROMPT_TOKENS + RESPONSE_TOKENS} tokens, "
          f"{group_mb:.2f} MB serialized")  # fmt: skip
    starts = range(0, args.groups, args.batch)

    with RedisServer() as server:
        buffer = SampleBuffer(server.config.model_copy(update={"max_groups": 1024}), "bench")
        client = connect(server.config)
        client.xgroup_create(RAW_STREAM, "trainer", id="0", mkstream=True)
        ids = count()
        sides: dict[str, Callable[[int], None]] = {
            "riptide": lambda i: riptide_batch(buffer, groups[i : i + args.batch], ids),
            "raw": lambda i: raw_batch(client, groups[i : i + args.batch], ids),
            "riptide_bytes": lambda i: riptide_bytes_batch(
                buffer, payloads[i : i + args.batch], ids
            ),
            "raw_bytes": lambda i: raw_bytes_batch(client, payloads[i : i + args.batch]),
        }
        names = list(sides)
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        turn = 0
        for round_index in range(args.rounds + 1):  # round 0 warms up and is not counted
            totals = dict.fromkeys(names, 0.0)
            for start in starts:
                turn += 1  # rotate which side goes first, batch by batch
                for name in names[turn % len(names) :] + names[: turn % len(names)]:
                    totals[name] += timed(partial(sides[name], start))
                client.xtrim(RAW_STREAM, maxlen=0)  # raw redis never deletes; keep memory flat
            if round_index:
                for name in names:
                    seconds[name].append(totals[name])
                print(f"round {round_index}: " + ", ".join(
                    f"{name} {args.groups / totals[name]:.1f} groups/s" for name in names
                ))  # fmt: skip
        buffer.close()
        client.close()

    result: dict[str, object] = {}
    for name, samples in seconds.items():
        groups_per_s = args.groups / statistics.median(samples)
        result[name] = {
            "groups_per_s": round(groups_per_s, 2),
            "mb_per_s": round(groups_per_s * group_mb, 1),
        }
    for suffix in ("", "_bytes"):
        ours, raw = result["riptide" + suffix], result["raw" + suffix]
        result["ratio" + suffix] = round(ours["groups_per_s"] / raw["groups_per_s"], 3)  # type: ignore[index]
    result["group_mb"] = round(group_mb, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
