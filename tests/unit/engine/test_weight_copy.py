"""The engine's weight copy: every target gets its source, large pairs one by one."""

from __future__ import annotations

import pytest
import torch

from services.engine.weight_copy import LARGE_BYTES, copy_weights, is_large, plan_copy, run_copy


def _pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    big = LARGE_BYTES // 2  # bfloat16 elements of exactly LARGE_BYTES
    shapes = [(big,), (7,), (big // 64, 64), (3, 5), (big - 1,)]
    sources = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    targets = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    return targets, sources


def test_every_target_gets_its_source_and_the_large_ones_go_one_by_one() -> None:
    targets, sources = _pairs()
    assert copy_weights(targets, sources) == 2  # the two of exactly LARGE_BYTES
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)


def test_views_of_one_parameter_are_filled_in_place() -> None:
    fused = torch.zeros(LARGE_BYTES // 2 + 8, dtype=torch.bfloat16)
    head, tail = fused[:LARGE_BYTES // 2], fused[LARGE_BYTES // 2:]
    sources = [torch.ones_like(head), torch.full_like(tail, 2.0)]
    copy_weights([head, tail], sources)
    assert torch.all(fused[:LARGE_BYTES // 2] == 1) and torch.all(fused[-8:] == 2)


def test_another_dtype_or_a_strided_pair_is_cast_in_the_grouped_copy() -> None:
    target = torch.zeros(LARGE_BYTES // 2, dtype=torch.bfloat16)
    source = torch.randn(LARGE_BYTES // 2, dtype=torch.float32)
    strided = torch.zeros(LARGE_BYTES // 2, 2, dtype=torch.bfloat16)[:, 0]
    assert not is_large(target, source) and not is_large(strided, target)
    assert copy_weights([target, strided], [source, source.to(torch.bfloat16)]) == 0
    assert torch.equal(target, source.to(torch.bfloat16))
    assert torch.equal(strided, source.to(torch.bfloat16))


def test_unequal_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="2 targets for 1 sources"):
        copy_weights([torch.zeros(1), torch.zeros(1)], [torch.ones(1)])


def test_nothing_to_copy_is_fine() -> None:
    assert copy_weights([], []) == 0


def _flat(sizes: list[int], fill: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    buffer = (torch.zeros(sum(sizes), dtype=torch.bfloat16) if fill is None
              else torch.randn(sum(sizes)).to(torch.bfloat16))
    return buffer, list(torch.split(buffer, sizes))


def test_pairs_back_to_back_on_both_sides_are_one_copy() -> None:
    sizes = [LARGE_BYTES // 2, 7, 64, LARGE_BYTES // 4, 3]
    target_buffer, targets = _flat(sizes)
    source_buffer, sources = _flat(sizes, fill=1.0)
    plan = plan_copy(targets, sources)
    assert plan.num_copies == 1 and plan.merged == len(sizes)
    run_copy(plan)
    assert torch.equal(target_buffer, source_buffer)


def test_a_gap_or_another_order_on_one_side_breaks_the_run_and_the_gap_is_untouched() -> None:
    target_buffer, targets = _flat([100, 50, 100, 100])
    source_buffer, pieces = _flat([100, 50, 100, 100], fill=1.0)
    # sources 0 and 1 back to back as their targets are; then the last two swapped
    sources = [pieces[0], pieces[1], pieces[3], pieces[2]]
    plan = plan_copy(targets, sources)
    assert plan.merged == 2 and plan.num_copies == 1  # [0, 1] merged; all small: one group
    run_copy(plan)
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)
    # a gap between two targets whose sources are back to back: the gap keeps its values
    gapped = torch.full((10,), 5.0, dtype=torch.bfloat16)
    source = torch.ones(8, dtype=torch.bfloat16)
    plan = plan_copy([gapped[:4], gapped[6:]], [source[:4], source[4:]])
    run_copy(plan)
    assert plan.merged == 0 and torch.all(gapped[4:6] == 5) and torch.all(gapped[6:] == 1)


def test_another_dtype_is_not_merged() -> None:
    _, targets = _flat([10, 10])
    sources = [torch.ones(10), torch.ones(10)]  # float32 into bfloat16
    plan = plan_copy(targets, sources)
    assert plan.merged == 0
    run_copy(plan)
    assert all(torch.all(t == 1) for t in targets)


def test_padding_between_targets_merges_where_the_sources_lie_as_far_apart() -> None:
    target_buffer = torch.zeros(300, dtype=torch.bfloat16)
    targets = [target_buffer[:100], target_buffer[128:228], target_buffer[256:300]]
    base, size = target_buffer.data_ptr(), target_buffer.element_size()
    padding = {base + 100 * size: base + 128 * size, base + 228 * size: base + 256 * size}
    source_buffer = torch.randn(300).to(torch.bfloat16)
    sources = [source_buffer[:100], source_buffer[128:228], source_buffer[256:300]]
    plan = plan_copy(targets, sources, padding)
    assert plan.merged == 3 and plan.num_copies == 1
    run_copy(plan)
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)
    # the same gap that is not known as padding (it may hold another parameter) is not copied
    untouched = torch.full((300,), 7.0, dtype=torch.bfloat16)
    plan = plan_copy([untouched[:100], untouched[128:228]], sources[:2])
    run_copy(plan)
    assert plan.merged == 0 and torch.all(untouched[100:128] == 7)
    # sources a different distance apart than the padding: no merge
    shifted = [source_buffer[:100], source_buffer[120:220]]
    assert plan_copy(targets[:2], shifted, padding).merged == 0
