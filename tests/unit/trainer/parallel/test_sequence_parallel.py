"""The layout checks for sequence and expert parallelism (the reference layout passes; bad
combinations are ConfigErrors naming the fields), and the sequence-parallel norms' marks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.common.errors import ConfigError
from services.trainer.config import TrainerConfig
from services.trainer.megatron_policy import check_moe_layout
from services.trainer.model_config import ParallelConfig
from services.trainer.parallel.parallel import check_sizes
from services.trainer.parallel.sequence_parallel import (
    HeadRMSNorm,
    SequenceParallelRMSNorm,
    grads_partial_over_tp,
    pad_rows,
)
from services.trainer.ranks import service_world_size

# The reference run (examples/glm52_tbench2): TP 2 with SP, CP 4, PP 4, EP 8, expert TP 1, DP 1.
REFERENCE = {"tensor_parallel": 2, "sequence_parallel": True, "context_parallel": 4,
             "pipeline_parallel": 4, "expert_parallel": 8, "data_parallel": 1}
MOE = SimpleNamespace(is_moe=True)
DENSE = SimpleNamespace(is_moe=False)


def _parallel(**fields: Any) -> ParallelConfig:
    return TrainerConfig.model_validate({"parallel": fields}).parallel


def test_reference_layout_passes_on_32_ranks() -> None:
    config = TrainerConfig.model_validate({"parallel": REFERENCE})
    assert service_world_size(config) == 32
    assert check_sizes(config.parallel, 32) == 1  # DP 1: EP 8 spans TP 2 x CP 4
    check_moe_layout(MOE, config.parallel)


def test_expert_parallel_draws_from_tensor_context_and_data_parallel() -> None:
    assert check_sizes(_parallel(tensor_parallel=2, sequence_parallel=True,
                                 expert_parallel=2), 2) == 1  # fmt: skip
    assert check_sizes(_parallel(tensor_parallel=2, sequence_parallel=True, context_parallel=2,
                                 expert_parallel=8), 8) == 2  # fmt: skip
    for fields, world in (
        ({**REFERENCE, "expert_parallel": 16}, 32),  # 16 does not divide 2 x 4 x 1
        ({"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 3}, 4),
        ({"expert_parallel": 2}, 1),
    ):
        with pytest.raises(ConfigError, match=r"expert_parallel=\d+ must divide tensor_parallel"):
            check_sizes(_parallel(**fields), world)
    with pytest.raises(ConfigError, match="expert_parallel=16"):
        service_world_size(TrainerConfig.model_validate(
            {"parallel": {**REFERENCE, "expert_parallel": 16}}))  # fmt: skip


def test_sequence_parallel_needs_tensor_parallel_and_moe_under_tp_needs_it() -> None:
    with pytest.raises(ConfigError, match="sequence_parallel needs tensor_parallel > 1"):
        check_sizes(_parallel(sequence_parallel=True), 2)
    no_sp = {**REFERENCE, "sequence_parallel": False}
    with pytest.raises(ConfigError, match="tensor_parallel=2 needs sequence_parallel"):
        service_world_size(TrainerConfig.model_validate({"parallel": no_sp}))
    tp2 = _parallel(tensor_parallel=2)  # EP 1: the MoE check needs the model
    assert check_sizes(tp2, 2) == 1
    with pytest.raises(ConfigError, match="trainer.parallel.sequence_parallel"):
        check_moe_layout(MOE, tp2)
    check_moe_layout(DENSE, tp2)
    check_moe_layout(MOE, _parallel(expert_parallel=2, data_parallel=2))


def test_norms_mark_the_weights_whose_grads_are_partial_over_tp() -> None:
    def config(tp: int, sp: bool) -> Any:
        return SimpleNamespace(sequence_parallel=sp, tensor_model_parallel_size=tp)

    x = torch.randn(5, 2, 8)
    norm = SequenceParallelRMSNorm(config(2, True), 8, eps=1e-6)
    reference = torch.nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(norm.weight)
    assert torch.equal(norm(x), reference(x))
    assert list(norm.state_dict()) == ["weight"]
    assert grads_partial_over_tp(norm.weight)
    assert not grads_partial_over_tp(SequenceParallelRMSNorm(config(2, False), 8).weight)
    assert grads_partial_over_tp(HeadRMSNorm(config(2, False), 8).weight)
    assert not grads_partial_over_tp(HeadRMSNorm(config(1, False), 8).weight)
    assert not grads_partial_over_tp(torch.nn.Parameter(torch.ones(2)))


def test_pad_rows_pads_to_the_right_only() -> None:
    ids = torch.arange(1, 8).view(1, 7)
    assert pad_rows(ids, 1) is ids
    padded = pad_rows(ids, 4)
    assert padded.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert pad_rows(padded, 4) is padded
