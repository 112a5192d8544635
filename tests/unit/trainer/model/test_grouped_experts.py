"""Grouped MoE experts against megatron's SequentialMLP with the same weights: the FFN math in
both layouts, a whole MoE layer (outputs, gradients, the router's auxiliary losses, expert-bias
token counts, replayed routes), whole models from Hugging Face weights, the checkpoint and
weight-sync names, and, on a GPU, torch's grouped GEMM in bf16.

Tolerances: fp32 on the CPU agrees to 1e-5 relative (the same products summed in another
order); bf16 on the GPU to 2e-2 relative (one bf16 rounding of each product's output)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.common.errors import ConfigError
from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.trainer.model.grouped_experts import (
    GroupedExperts,
    grouped_swiglu_ffn,
    use_grouped_experts,
    with_grouped_experts,
)
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model.routing_replay import RouteReplay
from services.trainer.model_config import ModelConfig, ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights

FP32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


def _loop_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int],
                    probs: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start : start + n] @ w1[e].T).chunk(2, dim=-1)
        out.append((F.silu(gate) * up * probs[start : start + n, None]) @ w2[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kernel", [False, True], ids=["batched", "grouped-gemm-layout"])
def test_the_ffn_equals_a_loop_over_experts_with_empty_and_odd_groups(kernel: bool) -> None:
    # The grouped-GEMM layout runs here through torch's per-group CPU kernel: its padding,
    # offsets and gathers are what the CUDA kernel gets.
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 11, 1, 19, 0]
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    w1 = torch.randn(6, 24, 16, generator=g, requires_grad=True)
    w2 = torch.randn(6, 16, 12, generator=g, requires_grad=True)
    probs = torch.rand(sum(counts), generator=g, requires_grad=True)
    ours = grouped_swiglu_ffn(x, w1, w2, torch.tensor(counts), probs, kernel=kernel)
    ref = _loop_reference(x, w1, w2, counts, probs)
    torch.testing.assert_close(ours, ref, **FP32)
    up = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad(ours, (x, w1, w2, probs), up),
                    torch.autograd.grad(ref, (x, w1, w2, probs), up), strict=True):
        torch.testing.assert_close(a, b, **FP32)
    with pytest.raises(ValueError, match="sums to 36 tokens"):
        grouped_swiglu_ffn(x[:-1], w1, w2, torch.tensor(counts), probs[:-1])


def _moe_config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=24, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001, moe_router_dtype="fp32", hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32,
    )  # fmt: skip
    return TransformerConfig(**{**fields, **overrides})


def _moe_layers(config: Any) -> tuple[Any, Any]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from services.trainer.model.model import _allow_moe_without_te

    _allow_moe_without_te()
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    grouped_spec = with_grouped_experts(spec)
    assert grouped_spec.submodules.mlp.submodules.experts.module is GroupedExperts
    torch.manual_seed(3)
    sequential = MoELayer(config, spec.submodules.mlp.submodules, layer_number=1)
    grouped = MoELayer(config, grouped_spec.submodules.mlp.submodules, layer_number=1)
    for layer in (sequential, grouped):
        layer.set_layer_number(1)  # the router logs its auxiliary losses by layer
    with torch.no_grad():
        sequential.router.expert_bias.normal_(0.0, 0.02)
    grouped.load_state_dict(sequential.state_dict(), strict=True)  # SequentialMLP's names
    return sequential, grouped


def _aux_losses() -> dict[str, torch.Tensor]:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    values = {name: entry["values"].clone() for name, entry in tracker.items()}
    for entry in tracker.values():
        entry["values"].zero_()
    return values


def _run(layer: Any, hidden: torch.Tensor, up: torch.Tensor) -> dict[str, Any]:
    x = hidden.clone().requires_grad_(True)
    layer.zero_grad()
    layer.router.local_tokens_per_expert.zero_()
    out, _ = layer(x)
    (out * up).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "router_grad": layer.router.weight.grad,
            "expert_grads": _expanded_grads(layer.experts), "aux": _aux_losses(),
            "tokens": layer.router.local_tokens_per_expert.clone()}


def _expanded_grads(model: Any) -> dict[str, torch.Tensor]:
    """Parameter gradients by name, grouped experts' as SequentialMLP's per-expert ones."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            prefix = f"{name}." if name else ""
            fc1, fc2 = grads.pop(prefix + "fc1_weight"), grads.pop(prefix + "fc2_weight")
            assert fc1 is not None and fc2 is not None
            for e in range(module.num_local_experts):
                grads[f"{prefix}local_experts.{e}.linear_fc1.weight"] = fc1[e]
                grads[f"{prefix}local_experts.{e}.linear_fc2.weight"] = fc2[e]
    return grads  # type: ignore[return-value]


def _marks(param: torch.Tensor) -> tuple[object, ...]:
    """megatron's parameter marks that the gradient sums and norms read (grad_norm.py)."""
    return (getattr(param, "allreduce", None), getattr(param, "tensor_model_parallel", None))


def test_a_moe_layer_is_the_same_with_grouped_experts() -> None:
    sequential, grouped = _moe_layers(_moe_config())
    marks = {_marks(p) for p in sequential.experts.parameters()}
    assert marks == {(True, True)}
    assert {_marks(p) for p in grouped.experts.parameters()} == marks
    ep2 = _moe_config(expert_model_parallel_size=2)
    assert {_marks(p) for p in GroupedExperts(4, ep2).parameters()} == {(False, True)}
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, 3, 32, generator=g)  # [S, B, H]
    up = torch.randn(7, 3, 32, generator=g)
    _aux_losses()
    a, b = _run(sequential, hidden, up), _run(grouped, hidden, up)
    for key in ("out", "x_grad", "router_grad"):
        torch.testing.assert_close(b[key], a[key], **FP32)
    assert set(a["aux"]) == {"load_balancing_loss", "z_loss"} and set(b["aux"]) == set(a["aux"])
    for name in a["aux"]:
        torch.testing.assert_close(b["aux"][name], a["aux"][name], **FP32)
    assert torch.equal(b["tokens"], a["tokens"]) and int(a["tokens"].sum()) == 21 * 2
    assert set(b["expert_grads"]) == set(a["expert_grads"])
    for name, grad in a["expert_grads"].items():
        torch.testing.assert_close(b["expert_grads"][name], grad, **FP32)
    assert sum(bool(grad.abs().sum() > 0) for grad in a["expert_grads"].values()) >= 8


def test_replayed_routes_reach_grouped_experts_unchanged() -> None:
    sequential, grouped = _moe_layers(_moe_config())
    g = torch.Generator().manual_seed(5)
    hidden, up = torch.randn(6, 2, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    routes = torch.randint(0, 8, (12, 2), generator=g)
    routes = torch.where(routes[:, :1] == routes[:, 1:], torch.stack([routes[:, 0],
                                                               (routes[:, 0] + 1) % 8], 1),
                         routes)  # fmt: skip
    routes[5] = -1  # a token without routes routes by itself
    hooks = []
    for layer in (sequential, grouped):
        hook = RouteReplay(0)
        hook.target = routes
        layer.router.router_replay = hook
        hooks.append(hook)
    a, b = _run(sequential, hidden, up), _run(grouped, hidden, up)
    replayed = torch.ones(12, dtype=torch.bool)
    replayed[5] = False
    for hook in hooks:
        assert hook.last_ids is not None
        assert torch.equal(hook.last_ids[replayed], routes[replayed])
    assert torch.equal(hooks[0].last_ids, hooks[1].last_ids)
    for key in ("out", "x_grad", "router_grad"):
        torch.testing.assert_close(b[key], a[key], **FP32)


def _model(arch: str, grouped: str, hf: Any) -> tuple[Any, ModelShape]:
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape, grouped_experts=grouped)
    load_hf_weights(model, shape, hf.state_dict())
    return model, shape


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm_moe_dsa"])
def test_models_from_hf_weights_train_the_same_and_keep_their_names(arch: str) -> None:
    hf = random_hf_model(arch)
    (seq, shape), (grp, _) = _model(arch, "off", hf), _model(arch, "on", hf)
    assert any(isinstance(m, GroupedExperts) for m in grp.modules())
    assert not any(isinstance(m, GroupedExperts) for m in seq.modules())
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    lp_seq, lp_grp = token_logprobs(seq, ids), token_logprobs(grp, ids)
    torch.testing.assert_close(lp_grp, lp_seq, **FP32)
    lp_seq.sum().backward()
    lp_grp.sum().backward()
    grads = _expanded_grads(grp)
    reference = dict(seq.named_parameters())
    assert set(grads) == set(reference)
    for name, param in reference.items():
        assert param.grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    # Checkpoints (state dicts) and the weight sync / export names are SequentialMLP's.
    state = grp.state_dict()
    assert set(state) == set(seq.state_dict())
    seq.load_state_dict(state, strict=True)
    hf_names = dict(iter_hf_tensors(grp, shape))
    for name, tensor in iter_hf_tensors(seq, shape):
        assert torch.equal(hf_names.pop(name), tensor), name
    assert not hf_names


def test_the_setting_is_checked() -> None:
    assert use_grouped_experts("auto") and not use_grouped_experts("off")
    with pytest.raises(ConfigError, match="none of auto, on, off"):
        use_grouped_experts("yes")
    with pytest.raises(ValueError, match="grouped_experts"):
        ModelConfig(grouped_experts="yes")  # type: ignore[arg-type]


def test_experts_other_than_swiglu_are_refused() -> None:
    config = _moe_config()
    config.gated_linear_unit = False
    with pytest.raises(ConfigError, match="SwiGLU"):
        GroupedExperts(2, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_grouped_gemm_equals_sequential_experts_on_the_gpu() -> None:
    from services.trainer.model.grouped_experts import kernel_fits

    config = _moe_config(hidden_size=256, moe_ffn_hidden_size=128,  # widths the kernel takes
                         params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=False)
    sequential, grouped = _moe_layers(config)
    sequential.cuda()
    grouped.cuda()
    g = torch.Generator(device="cuda").manual_seed(6)
    hidden = torch.randn(512, 2, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(512, 2, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    assert kernel_fits(hidden, grouped.experts.fc2_weight)
    _aux_losses()
    a, b = _run(sequential, hidden, up), _run(grouped, hidden, up)
    bf16 = {"atol": 2e-2, "rtol": 2e-2}
    for key in ("out", "x_grad", "router_grad"):
        scale = a[key].abs().max()
        torch.testing.assert_close(b[key] / scale, a[key] / scale, **bf16)
    assert torch.equal(b["tokens"], a["tokens"])
    for name, grad in a["expert_grads"].items():
        scale = grad.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(b["expert_grads"][name] / scale, grad / scale, **bf16)
