"""Turn finished groups into training tensors: advantages, token alignment, micro-batches.

Each scored sample becomes one row `prompt_ids + response_ids`; per-token arrays (loss mask,
rollout log-probs, advantages) line up with the token ids (index t belongs to token t), the
prompt part masked out. Rows are grouped, longest first, into micro-batches of at most
`max_tokens_per_microbatch` tokens: right-padded rows [B, S] (each row starts at position 0),
or with `packed` one row [1, T] of the samples back to back and their boundaries
`cu_seqlens`, no padding (megatron's THD layout; per-sequence positions come from the
boundaries). A sample longer than the budget is a micro-batch of its own. With
`shared_prefix` (packed only), the samples of a group hold their common prompt once per
micro-batch, each sample's continuation attending to it (shared_prefix.py, `prefix_of`).
Samples of MoE models may carry the engine's routed experts (Trajectory.routed_experts); a
micro-batch holds them per token as `routed_experts` for routing replay (routing_replay.py).
Called by data.py; consumed by step.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from services._proto.riptide.v1.common_pb2 import (
    VERDICT_STATUS_SCORED,
    Group,
    Trajectory,
    TrajectorySegment,
)
from services.common.errors import InvalidRequest
from services.common.routed_experts import unpack_routes
from services.trainer.attention.shared_prefix import shareable_len
from services.trainer.objective.loss import group_advantages


@dataclass
class MicroBatch:
    """Right-padded rows `[B, T]`, or one packed row `[1, T]` with `cu_seqlens`; per-token
    tensors aligned with `input_ids`."""

    input_ids: Tensor
    loss_mask: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    lengths: list[int]
    cu_seqlens: list[int] | None = None  # packed: sequence boundaries 0, len0, len0+len1, ...
    #: packed with shared prefixes: per sequence, the earlier one it continues (-1: none)
    prefix_of: list[int] | None = None
    #: the engine's routed experts [B, T, moe_layers, top_k] int32 (-1: none; None: no sample
    #: has any)
    routed_experts: Tensor | None = None

    @cached_property
    def num_loss_tokens(self) -> int:
        # counted once: reading it from a GPU tensor waits for the GPU
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with its tensors on `device` (itself when they are there)."""
        if self.input_ids.device == device:
            return self
        return MicroBatch(self.input_ids.to(device), self.loss_mask.to(device),
                          self.rollout_logprobs.to(device), self.advantages.to(device),
                          self.lengths, self.cu_seqlens, self.prefix_of,
                          None if self.routed_experts is None
                          else self.routed_experts.to(device))  # fmt: skip


@dataclass
class RolloutBatch:
    """`rollout_batch_size` groups as micro-batches, with what the loop must record."""

    micro_batches: list[MicroBatch]
    entry_ids: list[str]
    group_ids: list[str]
    rewards: list[float]
    min_weight_versions: list[int] = field(default_factory=list)
    #: Per trained sample, its group's oldest weight version (what staleness is judged by).
    sample_weight_versions: list[int] = field(default_factory=list)
    num_samples: int = 0
    num_tokens: int = 0
    num_dropped_samples: int = 0
    wait_s: float = 0.0

    @property
    def num_loss_tokens(self) -> int:
        return sum(mb.num_loss_tokens for mb in self.micro_batches)

    def on_device(self, device: torch.device) -> RolloutBatch:
        """A copy whose micro-batches live on `device` (the stream builds them on the CPU,
        which is also how rank 0 sends them to the other ranks)."""
        return replace(self, micro_batches=[mb.to(device) for mb in self.micro_batches])


@dataclass
class _Row:
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    advantage: float
    routes: np.ndarray | None = None  # [len(ids), moe_layers, top_k], -1 where none

    def tail(self, start: int) -> _Row:
        return _Row(self.ids[start:], self.mask[start:], self.logprobs[start:], self.advantage,
                    None if self.routes is None else self.routes[start:])


def _rows_of(group: Group, normalize_std: bool) -> tuple[list[_Row], list[float], int]:
    scored = [s for s in group.samples if s.status == VERDICT_STATUS_SCORED]
    if not scored:
        return [], [], len(group.samples)
    rewards = [s.reward for s in scored]
    adv = group_advantages(torch.tensor([rewards]), normalize_std)[0].tolist()
    rows = []
    for sample, a in zip(scored, adv, strict=True):
        # An episode's segments (agents behind the gateway) are rows of one advantage: the
        # baseline above counted the episode once.
        for segment in (sample, *sample.segments):
            row = _row(segment, a, sample.sample_id, group.group_id)
            row.routes = _routes(segment, sample, len(row.ids))
            rows.append(row)
    return rows, rewards, len(group.samples) - len(scored)


def _row(tokens: Trajectory | TrajectorySegment, advantage: float, sample_id: str,
         group_id: str) -> _Row:
    n = len(tokens.response_ids)
    if len(tokens.loss_mask) != n or len(tokens.rollout_logprobs) != n:
        raise InvalidRequest(
            f"sample {sample_id} of group {group_id}: loss_mask ({len(tokens.loss_mask)}) and "
            f"rollout_logprobs ({len(tokens.rollout_logprobs)}) must have one entry per "
            f"response token ({n})")
    p = len(tokens.prompt_ids)
    return _Row(ids=list(tokens.prompt_ids) + list(tokens.response_ids),
                mask=[0] * p + [int(m != 0) for m in tokens.loss_mask],
                logprobs=[0.0] * p + list(tokens.rollout_logprobs), advantage=advantage)


def _routes(tokens: Trajectory | TrajectorySegment, sample: Trajectory,
            num_tokens: int) -> np.ndarray | None:
    if not tokens.routed_experts:
        return None
    try:
        return unpack_routes(tokens.routed_experts, tokens.routed_experts_present, num_tokens,
                             sample.routed_experts_num_layers, sample.routed_experts_top_k)
    except InvalidRequest as exc:
        raise InvalidRequest(f"sample {sample.sample_id} of group {sample.group_id}: "
                             f"{exc}") from None


def _stack_routes(rows: list[_Row], shape: tuple[int, int], packed: bool) -> Tensor | None:
    """The rows' routes as [B, width, moe_layers, top_k] (one packed row: [1, T, ...]), -1
    where a row has none; None when no row has any."""
    given = [r.routes for r in rows if r.routes is not None]
    if not given:
        return None
    layout = given[0].shape[1:]
    if any(g.shape[1:] != layout for g in given):
        raise InvalidRequest("samples of one batch carry routed experts of different shapes")
    out = torch.full((*shape, *layout), -1, dtype=torch.int32)
    start = 0
    for i, r in enumerate(rows):
        n = len(r.ids)
        if r.routes is not None:
            if packed:
                out[0, start : start + n] = torch.from_numpy(r.routes)
            else:
                out[i, :n] = torch.from_numpy(r.routes)
        start += n
    return out


def _micro_batch(rows: list[_Row], pad_id: int) -> MicroBatch:
    width = max(len(r.ids) for r in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.float32)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    adv = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.ids)
        ids[i, :n] = torch.tensor(r.ids)
        mask[i, :n] = torch.tensor(r.mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(r.logprobs)
        adv[i, :n] = r.advantage
    return MicroBatch(ids, mask, logprobs, adv, [len(r.ids) for r in rows],
                      routed_experts=_stack_routes(rows, shape, packed=False))


def _packed_micro_batch(rows: list[_Row], prefix_of: list[int] | None = None) -> MicroBatch:
    lengths = [len(r.ids) for r in rows]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)

    def row(values: list[list[float]] | list[list[int]], dtype: torch.dtype) -> Tensor:
        return torch.tensor([v for part in values for v in part], dtype=dtype).unsqueeze(0)

    return MicroBatch(
        input_ids=row([r.ids for r in rows], torch.long),
        loss_mask=row([r.mask for r in rows], torch.float32),
        rollout_logprobs=row([r.logprobs for r in rows], torch.float32),
        advantages=row([[r.advantage] * len(r.ids) for r in rows], torch.float32),
        lengths=lengths,
        cu_seqlens=cu,
        prefix_of=prefix_of,
        routed_experts=_stack_routes(rows, (1, cu[-1]), packed=True),
    )


def _group_rows(rows: list[_Row], budget: int, packed: bool) -> list[list[_Row]]:
    """Rows (sorted longest first) cut into micro-batches of at most `budget` tokens."""
    out: list[list[_Row]] = []
    current: list[_Row] = []
    used = 0
    for row in rows:
        # Padded: the first row of a micro-batch sets its width. Packed: tokens add up.
        cost = len(row.ids) if packed else (len(current[0].ids) if current else len(row.ids))
        if current and used + cost > budget:
            out.append(current)
            current, used = [], 0
            cost = len(row.ids)
        current.append(row)
        used += cost
    if current:
        out.append(current)
    return out


def _micro_batches(rows: list[_Row], budget: int, pad_id: int, packed: bool) -> list[MicroBatch]:
    rows = sorted(rows, key=lambda r: len(r.ids), reverse=True)
    groups = _group_rows(rows, budget, packed)
    return [_packed_micro_batch(g) if packed else _micro_batch(g, pad_id) for g in groups]


@dataclass
class _Unit:
    """Rows that share a micro-batch: a group's shared prefix (or none) and the rows that
    continue it."""

    prefix: _Row | None
    rows: list[_Row]

    @property
    def cost(self) -> int:
        return (len(self.prefix.ids) if self.prefix else 0) + sum(len(r.ids) for r in self.rows)


def _shared_prefix_units(rows: list[_Row], budget: int) -> list[_Unit]:
    """One group's rows as units: the shared prompt once with as many continuations (longest
    first) as fit the budget beside it; a continuation alone is its whole row again."""
    shared = shareable_len([r.ids for r in rows], [r.mask for r in rows])
    rows = sorted(rows, key=lambda r: len(r.ids), reverse=True)
    if shared == 0:
        return [_Unit(None, [r]) for r in rows]
    routed = next((r.routes for r in rows if r.routes is not None), None)  # any sample's
    prefix = _Row(rows[0].ids[:shared], [0] * shared, [0.0] * shared, 0.0,
                  None if routed is None else routed[:shared])
    chunks: list[list[_Row]] = []
    used = budget
    for row in rows:
        if used + len(row.ids) - shared > budget:
            chunks.append([])
            used = shared
        chunks[-1].append(row)
        used += len(row.ids) - shared
    return [_Unit(None, chunk) if len(chunk) == 1 else
            _Unit(prefix, [r.tail(shared) for r in chunk]) for chunk in chunks]


def _shared_prefix_micro_batches(units: list[_Unit], budget: int) -> list[MicroBatch]:
    """Units packed (largest first) into rows of at most `budget` tokens; a unit larger than
    the budget is a row of its own."""
    out: list[MicroBatch] = []
    rows: list[_Row] = []
    prefix_of: list[int] = []
    used = 0
    for unit in sorted(units, key=lambda u: u.cost, reverse=True):
        if rows and used + unit.cost > budget:
            out.append(_packed_micro_batch(rows, prefix_of))
            rows, prefix_of, used = [], [], 0
        parent = -1
        if unit.prefix is not None:
            parent = len(rows)
            rows.append(unit.prefix)
            prefix_of.append(-1)
        rows += unit.rows
        prefix_of += [parent] * len(unit.rows)
        used += unit.cost
    if rows:
        out.append(_packed_micro_batch(rows, prefix_of))
    return out


def sequence_micro_batches(
    sequences: list[tuple[list[int], list[int]]],
    max_tokens_per_microbatch: int,
    pad_id: int = 0,
    packed: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of plain (ids, loss mask) sequences, as supervised fine-tuning trains on
    them (no advantages, no rollout log-probs), cut as `pack_groups` cuts samples."""
    rows = []
    for i, (ids, mask) in enumerate(sequences):
        if len(mask) != len(ids):
            raise InvalidRequest(f"sequence {i}: loss_mask ({len(mask)}) must have one entry "
                                 f"per id ({len(ids)})")
        rows.append(_Row(list(ids), [int(m != 0) for m in mask], [0.0] * len(ids), 0.0))
    return _micro_batches(rows, max_tokens_per_microbatch, pad_id, packed)


def pack_groups(
    entries: list[tuple[str, Group]],
    normalize_std: bool,
    max_tokens_per_microbatch: int,
    pad_id: int = 0,
    packed: bool = False,
    shared_prefix: bool = False,
) -> RolloutBatch:
    """Pack (entry_id, group) pairs into a RolloutBatch (`packed`: THD micro-batches;
    `shared_prefix`: each group's common prompt once per micro-batch); samples without a
    verdict are dropped."""
    if shared_prefix and not packed:
        raise ValueError("shared prefixes need packed micro-batches")
    rows: list[_Row] = []
    units: list[_Unit] = []
    rewards: list[float] = []
    sample_versions: list[int] = []
    dropped = 0
    for _, group in entries:
        group_rows, group_rewards, group_dropped = _rows_of(group, normalize_std)
        rows += group_rows
        if shared_prefix and group_rows:
            units += _shared_prefix_units(group_rows, max_tokens_per_microbatch)
        rewards += group_rewards
        sample_versions += [group.min_weight_version] * len(group_rewards)
        dropped += group_dropped
    return RolloutBatch(
        micro_batches=(_shared_prefix_micro_batches(units, max_tokens_per_microbatch)
                       if shared_prefix else
                       _micro_batches(rows, max_tokens_per_microbatch, pad_id, packed)),
        entry_ids=[entry_id for entry_id, _ in entries],
        group_ids=[g.group_id for _, g in entries],
        rewards=rewards,
        min_weight_versions=[g.min_weight_version for _, g in entries],
        sample_weight_versions=sample_versions,
        num_samples=len(rewards),
        num_tokens=sum(len(r.ids) for r in rows),
        num_dropped_samples=dropped,
    )
