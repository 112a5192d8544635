"""MoE experts as grouped matmuls: every local expert's SwiGLU FFN in two products, no Python
loop over experts.

megatron's local experts (`SequentialMLP`) split the tokens the dispatcher sorted by expert
and run one MLP per expert from Python: with GLM-5.2's 256 experts that is 256 small matmul
pairs a layer, each launched after a host sync. `GroupedExperts` holds the local experts'
weights stacked (`fc1_weight` [E, 2F, H] of [gate; up] rows, `fc2_weight` [E, H, F], each
expert's slice laid out as its `linear_fc1`/`linear_fc2` weight) and computes

    out = ((silu(x W_gate^T) * (x W_up^T)) * prob) W_down^T   for each token's expert,

the expert FFN of SequentialMLP with the router's probability applied after the activation
(megatron's `per_token_scale`). Each product is one `torch._grouped_mm`: on CUDA in bf16 the
CUTLASS grouped GEMM (sm90+), on the CPU torch's per-group kernel (a C++ loop of matmuls).
Tokens are laid out with each expert's group padded to a multiple of 8 rows, at least 8: the
CUDA kernel reads groups through TMA, which wants ragged group sizes of 16 bytes of bf16, and
some torch versions reject empty groups in the weight-gradient product; pad rows are zeros and
contribute nothing. Where `_grouped_mm` does not run (other CUDA dtypes, widths not a multiple
of 16 bytes, a torch without the CPU kernel) the products are one batched matmul over the
groups padded to the largest (exact too: each row meets only its own expert's weights).

The state dict keeps SequentialMLP's names (`local_experts.<e>.linear_fc1.weight`, views of
the stacked tensors), so Hugging Face conversion, trainer checkpoints, export and the weight
sync see the same tensors whichever experts module runs. The router and the token dispatcher
are megatron's, untouched: the allgather dispatcher (and alltoall under EP on CUDA) permutes
tokens with index ops, so routing, its auxiliary losses, expert-bias token counts and routing
replay are the same. `trainer.model.grouped_experts` chooses (`use_grouped_experts`).
Called by model.build_gpt_model and model_mla.build_mla_model (`with_grouped_experts`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.model.swiglu import swiglu

#: Rows of each expert's group in the CUDA grouped GEMM are a multiple of this (16 bytes).
GROUP_ALIGN = 8


def use_grouped_experts(setting: str) -> bool:
    """Whether `trainer.model.grouped_experts` = `setting` ("auto", "on", "off") runs the grouped
    experts. auto is on: on a GPU it is what the grouped GEMM is for; on the CPU it beat
    SequentialMLP at 3 of 4 measured layer shapes (1.28-1.39x; 0.88x at 8 experts of 2048
    tokens: bench/moe_experts.py, docs/trainer.md)."""
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"grouped_experts = {setting!r} is none of auto, on, off")
    return setting != "off"


def grouped_matmul(x: Tensor, weight: Tensor, layout: GroupLayout) -> Tensor:
    """Rows of `x` [rows, K] in `layout` times their group's `weight` [E, N, K] transposed."""
    if layout.kernel:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=layout.offsets)
    rows = x.view(layout.num_groups, layout.capacity, x.shape[-1])
    return torch.bmm(rows, weight.transpose(-2, -1)).view(-1, weight.shape[1])


class GroupLayout:
    """Where each of the T expert-sorted tokens sits in the padded group layout.

    kernel layout (torch._grouped_mm): groups back to back, each padded to a multiple of
    GROUP_ALIGN rows (at least GROUP_ALIGN), `offsets` their int32 ends. Batched layout: E
    groups of `capacity` rows each (the largest group)."""

    def __init__(self, tokens_per_expert: Tensor, device: torch.device, kernel: bool) -> None:
        counts = tokens_per_expert.to("cpu", torch.int64)  # megatron's dispatchers give it there
        self.kernel = kernel
        self.num_groups = counts.numel()
        self.num_tokens = int(counts.sum())
        starts = counts.cumsum(0) - counts
        if kernel:
            padded = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN).clamp(min=1) * GROUP_ALIGN
            ends = padded.cumsum(0)
            self.capacity = 0
            self.num_rows = int(ends[-1]) if self.num_groups else 0
            self.offsets: Tensor | None = ends.to(device=device, dtype=torch.int32)
            slot_starts = ends - padded
        else:
            self.capacity = int(counts.max()) if self.num_groups else 0
            self.num_rows = self.num_groups * self.capacity
            self.offsets = None
            slot_starts = torch.arange(self.num_groups) * self.capacity
        shift = (slot_starts - starts).to(device)
        expert = torch.repeat_interleave(torch.arange(self.num_groups, device=device),
                                         counts.to(device), output_size=self.num_tokens)
        self.rows = torch.arange(self.num_tokens, device=device) + shift[expert]

    def scatter(self, tokens: Tensor) -> Tensor:
        """`tokens` [T, ...] placed in their rows of the layout, zeros elsewhere."""
        out = tokens.new_zeros(self.num_rows, *tokens.shape[1:])
        return out.index_copy_(0, self.rows, tokens)  # in place: one copy of the tokens

    def gather(self, rows: Tensor) -> Tensor:
        """The T tokens' rows of a layout-shaped tensor, in token order."""
        return rows.index_select(0, self.rows)


def kernel_fits(hidden: Tensor, fc2_weight: Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these products: in bf16 on CUDA from sm90 on (the
    CUTLASS kernel; older torch builds have nothing below), on the CPU where this torch has its
    per-group kernel; rows of 16 bytes either way."""
    align = 16 // hidden.element_size()
    if hidden.shape[-1] % align or fc2_weight.shape[-1] % align:
        return False
    if hidden.is_cuda:
        major, _ = torch.cuda.get_device_capability(hidden.device)
        return hidden.dtype == torch.bfloat16 and major >= 9
    return hidden.device.type == "cpu" and _cpu_grouped_mm()


@functools.cache
def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.zeros(8, 8), torch.zeros(1, 8, 8),
                          offs=torch.tensor([8], dtype=torch.int32))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True


def grouped_swiglu_ffn(hidden: Tensor, fc1_weight: Tensor, fc2_weight: Tensor,
                       tokens_per_expert: Tensor, probs: Tensor,
                       kernel: bool | None = None) -> Tensor:
    """Each expert-sorted token's FFN output, scaled by its router probability (see the module
    doc); `tokens_per_expert` [E] sums to the tokens of `hidden` [T, H]. `kernel`: the
    grouped-GEMM layout (None: where `kernel_fits`; torch also runs it, per group, on the CPU)."""
    if kernel is None:
        kernel = kernel_fits(hidden, fc2_weight)
    layout = GroupLayout(tokens_per_expert, hidden.device, kernel)
    if layout.num_tokens != hidden.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {layout.num_tokens} tokens, hidden states "
                         f"hold {hidden.shape[0]}")
    x = layout.scatter(hidden)
    p = layout.scatter(probs.unsqueeze(-1))
    h = (swiglu(grouped_matmul(x, fc1_weight, layout)) * p).to(hidden.dtype)
    return layout.gather(grouped_matmul(h, fc2_weight, layout))


class GroupedExperts(torch.nn.Module):
    """The local experts of one MoE layer (megatron's experts interface: `forward(tokens sorted
    by expert, tokens_per_expert, probs) -> (output, None)`)."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None,
                 pg_collection: Any = None) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ConfigError("grouped experts compute the SwiGLU expert FFN only")
        if config.add_bias_linear or config.moe_apply_probs_on_input:
            raise ConfigError("grouped experts take neither expert biases nor "
                              "moe_apply_probs_on_input")
        if config.expert_tensor_parallel_size not in (None, 1):
            raise ConfigError("grouped experts need expert_tensor_parallel_size = 1")
        self.config = config
        self.num_local_experts = num_local_experts
        e, h, f = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        kwargs: dict[str, Any] = {"dtype": config.params_dtype, "device": device}
        self.fc1_weight = torch.nn.Parameter(torch.empty(e, 2 * f, h, **kwargs))
        self.fc2_weight = torch.nn.Parameter(torch.empty(e, h, f, **kwargs))
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.fc1_weight)
                config.output_layer_init_method(self.fc2_weight)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        # megatron's marks of its expert linears: held whole by each expert-TP rank (expert TP
        # is 1; a TP rank's gradient norm counts it, where it skips TP duplicates off rank 0),
        # and owned by one expert-parallel rank under EP
        for weight, dim in ((self.fc1_weight, 1), (self.fc2_weight, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
            weight.allreduce = config.expert_model_parallel_size == 1  # type: ignore[attr-defined]
        self.register_state_dict_post_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stacked_state)

    @torch.compiler.disable  # token counts are data: compiled, each count pattern recompiles
    def forward(self, hidden: Tensor, tokens_per_expert: Tensor,
                probs: Tensor) -> tuple[Tensor, None]:
        out = grouped_swiglu_ffn(hidden, self.fc1_weight, self.fc2_weight, tokens_per_expert,
                                 probs)
        return out, None

    def per_expert(self) -> dict[str, Tensor]:
        """SequentialMLP's names (relative to this module) for views of the stacked weights."""
        return dict(_expert_views(self.fc1_weight, self.fc2_weight))

    def backward_dw(self) -> None:
        """megatron's hook for deferred weight gradients: the weight gradients are not deferred."""


def _expert_views(fc1: Tensor, fc2: Tensor) -> list[tuple[str, Tensor]]:
    views = []
    for e in range(fc1.shape[0]):
        views.append((f"local_experts.{e}.linear_fc1.weight", fc1[e]))
        views.append((f"local_experts.{e}.linear_fc2.weight", fc2[e]))
    return views


def _per_expert_state(module: GroupedExperts, state: dict[str, Any], prefix: str,
                      metadata: Any) -> None:
    fc1, fc2 = state.pop(prefix + "fc1_weight"), state.pop(prefix + "fc2_weight")
    for name, view in _expert_views(fc1, fc2):
        state[prefix + name] = view
        # megatron's linear layers keep an empty `_extra_state` (TransformerEngine's slot)
        state[prefix + name.replace(".weight", "._extra_state")] = None


def _stacked_state(module: GroupedExperts, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for stacked, linear in (("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2")):
        names = [f"{prefix}local_experts.{e}.{linear}.weight"
                 for e in range(module.num_local_experts)]
        if all(name in state for name in names):
            state[prefix + stacked] = torch.stack([state.pop(name) for name in names])
        for name in names:
            state.pop(name.replace(".weight", "._extra_state"), None)


def grouped_expert_views(model: Any) -> dict[str, Tensor]:
    """Every GroupedExperts' per-expert views under their full SequentialMLP names."""
    views: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for local, tensor in module.per_expert().items():
                views[f"{name}.{local}"] = tensor.detach()
    return views


def with_grouped_experts(spec: Any) -> Any:
    """A copy of a layer spec or block spec (its `layer_specs`) whose MoE layers build
    GroupedExperts; `spec` itself where no layer is MoE."""
    layers = getattr(spec, "layer_specs", None)
    if layers is not None:
        spec = copy.deepcopy(spec)
        spec.layer_specs = [_grouped_layer(layer) for layer in layers]
        return spec
    return _grouped_layer(spec)


def _grouped_layer(layer: Any) -> Any:
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
    if not isinstance(getattr(mlp, "submodules", None), MoESubmodules):
        return layer
    layer = copy.deepcopy(layer)
    layer.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    return layer
