"""The MLP's SwiGLU (swiglu.py): its one-pass backward against autograd, and a dense model's
MLP running it with the same log-probs and gradients as megatron's own gated activation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.trainer.model import swiglu
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _autograd_swiglu(pre: torch.Tensor) -> torch.Tensor:
    a, b = pre.chunk(2, dim=-1)
    return F.silu(a) * b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_equals_autograd(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    pre = (torch.randn(3, 7, 2 * 1100, generator=gen) * 3).to(device, dtype)  # 1100: two blocks
    grad = torch.randn(3, 7, 1100, generator=gen).to(device, dtype)
    ours = pre.clone().requires_grad_()
    swiglu.swiglu(ours).backward(grad)
    reference = pre.float().requires_grad_()
    _autograd_swiglu(reference).backward(grad.float())
    assert ours.grad is not None and reference.grad is not None
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype is torch.float32 else {}
    torch.testing.assert_close(ours.grad, reference.grad.to(dtype), **tolerance)
    torch.testing.assert_close(swiglu.swiglu(pre), _autograd_swiglu(pre))


def test_backward_of_strided_gradient_and_empty_rows() -> None:
    pre = torch.randn(4, 6, requires_grad=True)
    grad = torch.randn(3, 4).t()  # [4, 3], not contiguous
    swiglu.swiglu(pre).backward(grad)
    reference = pre.detach().clone().requires_grad_()
    _autograd_swiglu(reference).backward(grad)
    torch.testing.assert_close(pre.grad, reference.grad)
    assert swiglu.swiglu_backward(torch.zeros(0, 3), torch.zeros(0, 6)).shape == (0, 6)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


def test_dense_mlp_runs_swiglu_like_megatrons_activation(one_rank: None) -> None:
    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape, dtype="float32", attention="fused")
    load_hf_weights(model, shape, hf.state_dict())
    assert all(isinstance(layer.mlp.activation_func, swiglu.SwiGLU)
               for layer in model.decoder.layers)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 12), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)

    def scores() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        lp = token_logprobs(model, ids)
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = scores()
    model.config.use_te_activation_func = False  # megatron's own chunk + silu * linear
    try:
        megatrons = scores()
    finally:
        model.config.use_te_activation_func = True
    torch.testing.assert_close(ours[0], megatrons[0], atol=1e-6, rtol=1e-6)
    for name, grad in megatrons[1].items():
        torch.testing.assert_close(ours[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_moe_and_te_layers_keep_megatrons_activation() -> None:
    from megatron.core.models.gpt import gpt_layer_specs

    moe = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False,
                                                   normalization="RMSNorm")  # fmt: skip
    assert swiglu.with_swiglu(moe) is moe and not swiglu.uses_swiglu(moe)
    dense = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    changed = swiglu.with_swiglu(dense)
    assert swiglu.uses_swiglu(changed) and not swiglu.uses_swiglu(dense)
