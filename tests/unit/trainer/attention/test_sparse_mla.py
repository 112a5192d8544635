"""Sparse MLA attention (services/trainer/attention/sparse_mla.py): its torch form equals dense
masked attention in outputs and gradients (padding, future picks), the absorbed form equals
attention over the up-projected heads, and GLM-5 with DSA gives the same log-probs and
gradients as the exact dense-mask path, also under full recomputation. The Triton kernels run
in TRITON_INTERPRET=1 mode where triton is installed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.errors import ConfigError
from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.testing.triton_interpreter import run_in_interpreter
from services.trainer.attention.mla_attention import MLACoreAttention
from services.trainer.attention.sparse_mla import (
    absorbed_sparse_attention,
    sparse_mla,
    torch_backward,
    torch_forward,
)
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights


def _indices(batch: int, seq: int, topk: int, seed: int) -> torch.Tensor:
    """Distinct random picks per query (future ones too), with some -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(seq, generator=gen)[:topk] for _ in range(batch * seq)]
    picks = torch.stack(rows).view(batch, seq, topk)
    picks[:, :, 0] = torch.arange(seq)  # every query keeps itself (no empty softmax)...
    picks[:, :, 1:] = torch.where(picks[:, :, 1:] == torch.arange(seq)[None, :, None], -1,
                                  picks[:, :, 1:])  # ...once
    picks[:, ::3, -2:] = -1
    return picks


def _dense(q: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor,
           scale: float, v_dim: int) -> torch.Tensor:
    chosen = torch.zeros(picks.shape[0], picks.shape[1], kv.shape[1] + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(picks < 0, kv.shape[1], picks), True)
    chosen = chosen[..., :-1] & (torch.arange(kv.shape[1])[None, :] <= positions[:, None])
    scores = torch.einsum("bqhd,bkd->bhqk", q, kv) * scale
    probs = torch.softmax(scores.masked_fill(~chosen[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkv->bqhv", probs, kv[..., :v_dim])


@pytest.mark.parametrize("chunk_budget", [None, 64])
def test_torch_form_equals_dense_masked_attention(
    chunk_budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.attention import sparse_mla as module

    if chunk_budget is not None:
        monkeypatch.setattr(module, "_GATHER_BUDGET", chunk_budget)  # one query a chunk
    b, s, h, d, v, k = 2, 29, 3, 12, 8, 7
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(b, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    picks, positions = _indices(b, s, k, 1), torch.arange(s)
    out = sparse_mla(q, kv, picks, positions, 0.4, v)
    ref = _dense(q, kv, picks, positions, 0.4, v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, (q, kv), grad)
    theirs = torch.autograd.grad(ref, (q, kv), grad)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=0)
    # The picks matter: future keys and padding are masked, the rest are used.
    assert (out - _dense(q, kv, picks.clamp(min=0), positions, 0.4, v)).abs().max() > 0.1


def test_query_positions_mask_keys_after_the_query() -> None:
    """A CP rank's queries sit at row positions of their own: a key after it is never seen."""
    gen = torch.Generator().manual_seed(2)
    q, kv = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 6, 8, generator=gen)
    picks = torch.tensor([[[0, 4, 5], [0, 4, 5]]])
    out = sparse_mla(q, kv, picks, torch.tensor([4, 5]), 1.0, 8)
    first = _dense(q[:, :1], kv, picks[:, :1], torch.tensor([4]), 1.0, 8)
    torch.testing.assert_close(out[:, :1], first)
    alone = _dense(q[:, :1], kv, torch.tensor([[[0, 4]]]), torch.tensor([4]), 1.0, 8)
    torch.testing.assert_close(out[:, :1], alone)  # key 5 > position 4: dropped


def test_bad_shapes_are_refused() -> None:
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 8)
    with pytest.raises(ConfigError, match="indices"):
        sparse_mla(q, kv, torch.zeros(1, 3, 2, dtype=torch.long), torch.arange(4), 1.0, 8)
    with pytest.raises(ConfigError, match="v_dim"):
        sparse_mla(q, kv, torch.zeros(1, 4, 2, dtype=torch.long), torch.arange(4), 1.0, 9)


def test_absorbed_form_equals_attention_over_up_projected_heads() -> None:
    b, s, h, nope, rope, r, v, k = 1, 17, 2, 6, 4, 5, 3, 5
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    q_nope, q_rope = rand(b, s, h, nope), rand(b, s, h, rope)
    latent, k_rope = rand(b, s, r), rand(b, s, rope)
    w_uk, w_uv = rand(h, nope, r), rand(h, v, r)
    picks, positions = _indices(b, s, k, 4), torch.arange(s)
    out = absorbed_sparse_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, picks,
                                    positions, 0.3)
    keys = torch.cat([torch.einsum("bsr,hnr->bshn", latent, w_uk),
                      k_rope[:, :, None].expand(-1, -1, h, -1)], dim=-1)
    values = torch.einsum("bsr,hvr->bshv", latent, w_uv)
    heads = []
    for i in range(h):
        scores = torch.einsum("bqd,bkd->bqk", torch.cat([q_nope, q_rope], -1)[:, :, i],
                              keys[:, :, i]) * 0.3
        chosen = torch.zeros(b, s, s + 1, dtype=torch.bool)
        chosen.scatter_(-1, torch.where(picks < 0, s, picks), True)
        chosen = chosen[..., :-1] & (torch.arange(s)[None, :] <= positions[:, None])
        probs = torch.softmax(scores.masked_fill(~chosen, float("-inf")), dim=-1)
        heads.append(torch.einsum("bqk,bkv->bqv", probs, values[:, :, i]))
    ref = torch.stack(heads, dim=2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    params = (q_nope, q_rope, latent, k_rope, w_uk, w_uv)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, r_ in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad),
                     strict=True):
        torch.testing.assert_close(a, r_, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


def _glm(recompute: dict[str, Any] | None = None) -> tuple[Any, torch.Tensor]:
    hf = random_hf_model("glm_moe_dsa", num_layers=4, num_kv_heads=4, index_topk=6,
                         index_n_heads=8)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape, recompute=recompute)
    load_hf_weights(model, shape, hf.state_dict())
    ids = torch.randint(0, 96, (2, 31), generator=torch.Generator().manual_seed(5))
    return model, ids


def _logprobs_and_grads(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    model.zero_grad()
    model.train()
    logprobs = token_logprobs(model, ids)
    (logprobs[:, 1:] * torch.linspace(-1, 1, ids.shape[1] - 1)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal up to float32 rounding, relative to the gradient's largest entry."""
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-7, name


def test_glm_sparse_path_equals_exact_path_and_recompute(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ids = _glm()
    sparse, sparse_grads = _logprobs_and_grads(model, ids)
    monkeypatch.setattr(MLACoreAttention, "exact_dsa", True)
    exact, exact_grads = _logprobs_and_grads(model, ids)
    monkeypatch.undo()
    # Log-probs reach -9 here; the two paths sum in different orders, a few float32 ulps apart.
    torch.testing.assert_close(sparse, exact, atol=1e-5, rtol=1e-5)
    assert sparse_grads.keys() == exact_grads.keys() and len(exact_grads) > 20
    for name, grad in exact_grads.items():
        _close(sparse_grads[name], grad, name)
    assert any("linear_kv_up_proj" in n and g.abs().sum() > 0 for n, g in sparse_grads.items())
    recomputed, _ = _glm({"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1})
    recomputed.load_state_dict(model.state_dict())
    again, again_grads = _logprobs_and_grads(recomputed, ids)
    torch.testing.assert_close(again, sparse, atol=1e-6, rtol=0)
    for name, grad in sparse_grads.items():
        _close(again_grads[name], grad, name)


def test_selective_recompute_is_refused_with_dsa(one_rank: None) -> None:
    with pytest.raises(ConfigError, match="selective"):
        _glm({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]})


def interpreter_check() -> None:
    """The Triton kernels (both backward variants) against the torch form, on the CPU in
    TRITON_INTERPRET=1 mode (run in a process of its own: Triton reads the mode when it is
    first imported, and other tests may import it first)."""
    from services.trainer.attention import sparse_mla_triton as kernels

    b, s, h, v, rope, k = 1, 40, 3, 16, 16, 24
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(b, s, h, v + rope, generator=gen)
    kv = torch.randn(b, s, v + rope, generator=gen)
    picks, positions = _indices(b, s, k, 7), torch.arange(s)
    out, lse = kernels.forward(q, kv, picks, positions, 0.2, v)
    ref_out, ref_lse = torch_forward(q, kv, picks, positions, 0.2, v)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    grad = torch.randn(out.shape, generator=gen)
    want = torch_backward(grad, q, kv, picks, positions, ref_out, ref_lse, 0.2)
    for variant in ("split", "fused"):
        kernels.BACKWARD = variant
        got = kernels.backward(grad, q, kv, picks, positions, ref_out, ref_lse, 0.2)
        for a, r in zip(got, want, strict=True):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=0, msg=variant)
    print("interpreter check passed")


@pytest.mark.slow
def test_triton_kernels_in_interpreter_equal_the_torch_form() -> None:
    pytest.importorskip("triton")
    assert "interpreter check passed" in run_in_interpreter(__file__, "interpreter_check")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 300, 64, 512, 64, 128), (2, 257, 5, 64, 32, 48)])
@pytest.mark.parametrize("variant", ["split", "split-pairs", "fused"])
def test_cuda_kernels_equal_the_torch_form(
    shape: tuple[int, ...], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") != "1"
    from services.trainer.attention import sparse_mla_triton as kernels

    monkeypatch.setattr(kernels, "BACKWARD", variant.removesuffix("-pairs"))
    monkeypatch.setattr(kernels, "VECTOR_ATOMICS", variant.endswith("-pairs"))
    b, s, h, v, rope, k = shape
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(b, s, h, v + rope, device="cuda", generator=gen, dtype=torch.bfloat16)
    kv = torch.randn(b, s, v + rope, device="cuda", generator=gen, dtype=torch.bfloat16)
    picks, positions = _indices(b, s, k, 9).cuda(), torch.arange(s, device="cuda")
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out = sparse_mla(q, kv, picks, positions, 0.05, v)  # the kernels
    grad = torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    got_q, got_kv = torch.autograd.grad(out, (q, kv), grad)
    ref, ref_lse = torch_forward(q.double(), kv.double(), picks, positions, 0.05, v)
    ref_q, ref_kv = torch_backward(grad.double(), q.double(), kv.double(), picks, positions,
                                   ref, ref_lse, 0.05)
    for name, a, r in (("out", out, ref), ("dq", got_q, ref_q), ("dkv", got_kv, ref_kv)):
        err = float((a.double() - r).abs().max() / r.abs().max())
        print(f"sparse MLA CUDA {shape} {variant} {name}: max error / max {err:.2e}")
        assert err < 2e-2, (name, err)


def test_dense_mla_sdpa_equals_the_exact_path(one_rank: None) -> None:
    """The fused SDPA form MLA layers without DSA take on CUDA (V padded to the qk width),
    run here on the CPU against the exact materialized path, forward and gradients."""
    hf = random_hf_model("deepseek_v3", num_layers=1, num_kv_heads=4)
    shape = ModelShape.from_hf(hf.config)
    attention = build_gpt_model(shape).decoder.layers[0].self_attention.core_attention
    gen = torch.Generator().manual_seed(10)
    dk, dv = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim
    assert dv < dk  # the padded case
    heads = shape.num_heads
    q, k = (torch.randn(13, 2, heads, dk, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(13, 2, heads, dv, generator=gen, requires_grad=True)
    fused = attention._sdpa(q, k, v)
    exact = attention(q, k, v, None)
    torch.testing.assert_close(fused, exact, atol=1e-5, rtol=0)
    grad = torch.randn(fused.shape, generator=gen)
    for a, r in zip(torch.autograd.grad(fused, (q, k, v), grad),
                    torch.autograd.grad(exact, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=0)


def test_vector_atomics_only_where_compiled_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from services.trainer.attention import sparse_mla_triton as kernels

    monkeypatch.setattr(kernels, "VECTOR_ATOMICS", True)
    assert not kernels.vector_pairs(torch.zeros(1, 1, 1, 32))  # CPU tensors: never
    monkeypatch.setattr(kernels, "VECTOR_ATOMICS", False)
    assert not kernels.vector_pairs(torch.zeros(1, 1, 1, 32))
