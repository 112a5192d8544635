"""Compiled transformer layers (layer_compile.py) against eager ones, and the attention's
contiguous output gradient that cuDNN's SDPA backward needs behind them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.trainer.attention import fused_attention
from services.trainer.model.layer_compile import compile_layers, should_compile
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ModelConfig, ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.optim.contiguous_grad import contiguous_grad
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights


def test_auto_compiles_only_on_a_gpu() -> None:
    model = torch.nn.Linear(2, 2)
    assert not should_compile("auto", model)
    assert should_compile("on", model) and not should_compile("off", model)
    assert ModelConfig().compile_layers == "auto"


def test_attention_output_hands_back_a_contiguous_gradient() -> None:
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    out = fused_attention._sdpa(q, q, q, is_causal=True)
    assert type(out.grad_fn).__name__ == "_ContiguousGradBackward"
    seen: list[torch.Tensor] = []
    inner = q * 1.0
    inner.register_hook(seen.append)  # what reaches the kernel's backward
    arrived = torch.randn(4, 5, 2, 1).permute(3, 2, 1, 0)  # a strided gradient, as compiled
    assert not arrived.is_contiguous()
    contiguous_grad(inner).backward(arrived)
    assert seen[0].is_contiguous()
    torch.testing.assert_close(seen[0], arrived)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


@pytest.mark.slow
def test_compiled_layers_score_like_eager_ones(one_rank: None) -> None:
    """Padded rows, a packed row and a shared-prefix row through layers compiled by dynamo
    (aot_eager: dynamo's graphs and graph breaks, autograd traced ahead, no code generation):
    the same log-probs and gradients as eager."""
    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape, dtype="float32", attention="fused")
    load_hf_weights(model, shape, hf.state_dict())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, 30), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)
    rows: dict[str, dict[str, Any]] = {
        "padded": {}, "packed": {"cu_seqlens": [0, 18, 30]},
        "shared_prefix": {"cu_seqlens": [0, 10, 18, 30], "prefix_of": [-1, 0, 0]},
    }  # fmt: skip

    def scores() -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        out = {}
        for name, kwargs in rows.items():
            model.zero_grad()
            lp = token_logprobs(model, ids, **kwargs)
            (lp * weights).sum().backward()
            out[name] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        return out

    eager = scores()
    assert compile_layers(model, backend="aot_eager") == 2
    compiled = scores()
    for name in rows:
        torch.testing.assert_close(compiled[name][0], eager[name][0], atol=1e-5, rtol=0)
        worst = max(float((compiled[name][1][n] - g).abs().max() / g.abs().max())
                    for n, g in eager[name][1].items())  # fmt: skip
        assert worst < 1e-4, (name, worst)  # fp32 rounding of reordered sums


@pytest.mark.slow
def test_layers_compile_whole_and_once_per_packed_shape(one_rank: None) -> None:
    """What dynamo builds for the layers (a backend that counts its graphs): a padded row's
    layer is one graph, not split at megatron's row-parallel linears (whose tp_group lookup
    warned) nor at the RoPE tables; packed rows of new layouts with the same longest sequence
    build nothing new, because the packed attention and the tables' cache run outside the
    graphs (traced, their Python split a layer per sequence and became guards that failed
    for each new layout until dynamo gave up)."""
    torch._dynamo.reset()
    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_gpt_model(ModelShape.from_hf(hf.config), dtype="float32", attention="fused")
    graphs: list[Any] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compile_layers(model, backend=counting)
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        token_logprobs(model, ids).sum().backward()
    assert len(graphs) == 1
    built = []
    for cu in ([0, 18, 30], [0, 18, 24, 30], [0, 18, 20, 25, 28, 30], [0, 12, 30]):
        token_logprobs(model, ids[:1], cu_seqlens=cu).sum().backward()
        built.append(len(graphs))
    assert built[1] == built[2] == built[3], built
    torch._dynamo.reset()


def _recompute(model: Any, on: bool) -> None:
    config = model.config  # megatron reads these at each forward, as the trainer sets them
    config.recompute_granularity = "full" if on else None
    config.recompute_method = "uniform" if on else None
    config.recompute_num_layers = 1 if on else None


@pytest.mark.slow
def test_layers_stay_compiled_through_every_kind_of_input(one_rank: None) -> None:
    """Padded rows of two shapes, recompute, packed rows of two layouts, no-grad forwards (the
    old policy's) of both: each kind needs its own compiled version of the layer, more than
    dynamo's default allows, after which it would run the layer eagerly for good
    (fail_on_recompile_limit_hit makes that an error here)."""
    torch._dynamo.reset()
    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_gpt_model(ModelShape.from_hf(hf.config), dtype="float32", attention="fused")
    compile_layers(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)

    def step(rows: int, length: int, cu: list[int] | None = None, grad: bool = True) -> None:
        ids = torch.randint(0, 96, (rows, length), generator=gen)
        with torch.set_grad_enabled(grad):
            lp = token_logprobs(model, ids, cu_seqlens=cu)
            if grad:
                lp.sum().backward()

    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            step(4, 16)
            step(2, 32)
            _recompute(model, True)
            step(1, 64)
            _recompute(model, False)
            step(1, 64, [0, 16, 32, 48, 64])
            step(1, 40, [0, 10, 22, 40])
            step(1, 40, [0, 10, 22, 40], grad=False)
            step(2, 32, grad=False)
    finally:
        _recompute(model, False)
        torch._dynamo.reset()
