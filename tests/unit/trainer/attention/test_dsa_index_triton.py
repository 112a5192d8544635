"""The DSA indexer's fused Triton scores (services/trainer/attention/dsa_index_triton.py) equal
the torch form (sparse_attention._index_scores): on the CPU in TRITON_INTERPRET=1 mode where
triton is installed, on a GPU in bfloat16 (there the indexer's top-k picks too)."""

from __future__ import annotations

import os

import pytest
import torch

from services.testing.triton_interpreter import run_in_interpreter
from services.trainer.attention import sparse_attention
from services.trainer.attention.sparse_attention import _index_scores


def _inputs(b: int, s: int, t: int, heads: int, d: int, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(b, s, heads, d, generator=gen, device=device).to(dtype)
    k = torch.randn(b, t, d, generator=gen, device=device).to(dtype)
    w = torch.randn(b, s, heads, generator=gen, device=device)
    return q, k, w


def interpreter_check() -> None:
    """Run in a process of its own with TRITON_INTERPRET=1 (Triton reads the mode when it is
    first imported). The interpreter computes in float32, so the kernel's float32 form is
    compared; partial tiles, two rows, and a chunk of later queries (CP-like positions)."""
    from services.trainer.attention import dsa_index_triton

    q, k, w = _inputs(2, 70, 70, 3, 16)
    positions = torch.arange(70)
    got = dsa_index_triton.index_scores(q, k, w, positions, 0.3)
    want = _index_scores(q, k, w, positions, 0.3)
    assert torch.equal(got.isneginf(), want.isneginf())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    later = torch.tensor([5, 6, 7, 60, 61, 62, 63, 64, 65])  # two zigzag halves of a CP rank
    got = dsa_index_triton.index_scores(q[:, :9], k, w[:, :9], later, 0.3)
    want = _index_scores(q[:, :9], k, w[:, :9], later, 0.3)
    assert torch.equal(got.isneginf(), want.isneginf())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    print("interpreter check passed")


@pytest.mark.slow
def test_index_kernel_in_interpreter_equals_the_torch_form() -> None:
    pytest.importorskip("triton")
    assert "interpreter check passed" in run_in_interpreter(__file__, "interpreter_check")


def test_the_kernel_is_used_only_where_its_products_are_exact() -> None:
    from services.trainer.attention import dsa_index_triton

    q = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16)
    assert not dsa_index_triton.supports(q)  # on the CPU the torch form runs
    assert not dsa_index_triton.supports(q.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_scores_and_picks_equal_the_torch_form() -> None:
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") != "1"
    from services.trainer.attention import dsa_index_triton

    q, k, w = _inputs(1, 1000, 1000, 32, 128, "cuda", torch.bfloat16)
    assert dsa_index_triton.supports(q)
    positions = torch.arange(1000, device="cuda")
    got = dsa_index_triton.index_scores(q, k, w, positions, 128**-0.5)
    want = _index_scores(q, k, w, positions, 128**-0.5)
    assert torch.equal(got.isneginf(), want.isneginf())
    finite = want.isfinite()
    err = float((got[finite] - want[finite]).abs().max() / want[finite].abs().max())
    print(f"DSA index scores on CUDA: max error / max {err:.2e}")
    assert err < 1e-5
    # The indexer picks the same keys through either form (a pick may differ only where two
    # scores are within rounding of each other at the top-k boundary).
    picked = [torch.zeros_like(want, dtype=torch.bool).scatter_(
        -1, scores.topk(256, dim=-1, sorted=False).indices, True) for scores in (got, want)]
    assert (picked[0] & picked[1]).sum() / picked[1].sum() > 0.999
    assert sparse_attention.dsa_index_triton is dsa_index_triton
