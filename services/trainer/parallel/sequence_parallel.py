"""Sequence parallelism (SP) on megatron's local layer spec, without TransformerEngine.

With `sequence_parallel` megatron keeps the activations between the attention and MLP blocks
split along the sequence over the TP ranks (S/TP tokens each): the column-parallel linears
all-gather the sequence, the row-parallel ones reduce-scatter it, the embedding scatters it
and the output layer gathers it, so the logits cover whole rows as without SP. What runs on
the split sequence (the norms, the MoE router, the shared-expert gate) holds replicated
weights whose gradient each TP rank has for its own tokens only: megatron marks those
parameters `sequence_parallel = True`, and grad_norm.py sums their gradients over TP (they
stay TP duplicates, so the global norm counts them once). The local spec's torch norm refuses
SP; `SequenceParallelRMSNorm` is the same RMSNorm marked that way. The per-head q/k norms of
Qwen3 see only their rank's heads under any TP, so `HeadRMSNorm` marks them whenever TP > 1
(megatron's finalize_model_grads sums q/k layernorm gradients over TP as well).

MLA's latent KV down-projection needs one more change under SP. With the local spec it is a
column-parallel linear whose output megatron all-gathers over TP; the rope part of that output
(the shared rope key) then feeds this rank's heads only, but the gather's backward keeps each
rank's own slice of the gradient, so the other ranks' heads' share of the rope key's gradient
is lost. `use_latent_kv_projection` makes the projection compute the whole output on each
rank's tokens from its all-gathered weight shards (megatron's TransformerEngine spec does the
same with a duplicated linear): MLA then gathers the rope key over the sequence, whose backward
sums the heads' shares, and the weight's gradient is reduce-scattered back to the shards.

A row's length must be a multiple of TP under SP (per CP rank: CP cuts rows first):
`sequence_multiple` gives the factor and `pad_rows` pads to the right, which changes no real
token's log-prob under causal attention. Used by model.py and model_mla.py (`use_tp_norms`),
grad_norm.py, logprobs.py and context_parallel.py; model_mla.py calls
`use_latent_kv_projection`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import Tensor

ATTRIBUTE = "sequence_parallel"  # megatron's mark (router.py, shared_experts.py, TE norms)


def grads_partial_over_tp(param: Tensor) -> bool:
    """Whether each TP rank holds only its share of `param`'s gradient (sum it over TP)."""
    return bool(getattr(param, ATTRIBUTE, False))


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built from megatron's norm arguments, accepting sequence parallelism
    (its weight is then marked for the TP sum of its gradient)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, ATTRIBUTE, bool(config.sequence_parallel))


class HeadRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm over one attention head (q/k norms): TP splits the heads, so its
    weight's gradient is partial over TP whenever TP > 1."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, ATTRIBUTE, config.tensor_model_parallel_size > 1)


def use_tp_norms(spec: Any, config: Any) -> Any:
    """A copy of a local GPT layer spec (or block spec) as a block spec whose torch norms are
    this module's: sequence norms (input, pre-MLP, final; MLA's latent q/kv norms) become
    `SequenceParallelRMSNorm`, per-head q/k norms `HeadRMSNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = copy.deepcopy(spec)
    if not isinstance(spec, TransformerBlockSubmodules):
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=WrappedTorchNorm
        )
    if spec.layer_norm is WrappedTorchNorm:
        spec.layer_norm = SequenceParallelRMSNorm
    head_norm = SequenceParallelRMSNorm if config.multi_latent_attention else HeadRMSNorm
    for layer in spec.layer_specs:
        sub = layer.submodules
        for owner, name, norm in (
            (sub, "input_layernorm", SequenceParallelRMSNorm),
            (sub, "pre_mlp_layernorm", SequenceParallelRMSNorm),
            (sub.self_attention.submodules, "q_layernorm", head_norm),
            (sub.self_attention.submodules, "k_layernorm", head_norm),
            (sub.self_attention.submodules, "kv_layernorm", SequenceParallelRMSNorm),
        ):
            if getattr(owner, name, None) is WrappedTorchNorm:
                setattr(owner, name, norm)
    return spec


def _latent_kv_forward(self: Any, input_: Tensor, *_: Any, **__: Any) -> tuple[Tensor, None]:
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    weight = gather_from_sequence_parallel_region(self.weight, group=self.tp_group)
    return torch.nn.functional.linear(input_, weight), None


def use_latent_kv_projection(model: Any) -> None:
    """Under SP with TP > 1: every MLA layer's `linear_kv_down_proj` (a column-parallel
    linear, whose parameter and its TP split stay as they are) computes its whole output on
    this rank's tokens (see the module doc)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if not model.config.sequence_parallel:
        return
    for module in model.modules():
        projection = getattr(module, "linear_kv_down_proj", None)
        if isinstance(projection, ColumnParallelLinear) and projection.bias is None:
            projection.__class__ = _latent_kv_class()


@functools.cache
def _latent_kv_class() -> type:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return type("LatentKVProjection", (ColumnParallelLinear,), {"forward": _latent_kv_forward})


def sequence_multiple(model: Any) -> int:
    """What a row's (CP rank's) length must be a multiple of for `model`: TP under SP, else 1."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return int(config.tensor_model_parallel_size) if config.sequence_parallel else 1


def pad_rows(input_ids: Tensor, multiple: int, pad_id: int = 0) -> Tensor:
    """Rows [B, S] right-padded with `pad_id` to a length that is a multiple of `multiple`."""
    batch, seq = input_ids.shape
    padded_len = -(-seq // multiple) * multiple
    if padded_len == seq:
        return input_ids
    padded = input_ids.new_full((batch, padded_len), pad_id)
    padded[:, :seq] = input_ids
    return padded
