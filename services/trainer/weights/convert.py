"""Convert weights between Hugging Face checkpoints and this rank's megatron-core model.

`load_hf_weights` fills this rank's shards from full Hugging Face tensors (fusing QKV by query
group and fc1 as [gate; up], slicing for TP and for the rank's pipeline stage and experts).
`iter_hf_tensors` goes the other way and must be driven by every rank of the model: it gathers
TP shards, broadcasts expert shards over EP and layers over PP, so that each rank ends up with
each full tensor under its Hugging Face name; `iter_hf_buckets` groups them into buckets of
`bucket_mb` for the weight sync (weight_sync.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.common.errors import InvalidRequest
from services.trainer.model.model import ModelShape
from services.trainer.parallel.pipeline_layout import owner_stage, stage_layer_counts
from services.trainer.weights import weight_map
from services.trainer.weights.weight_map import TensorRule, tensor_rules


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP or Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _groups() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "tp_group": ps.get_tensor_model_parallel_group(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "pp_group": ps.get_pipeline_model_parallel_group(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "ep_group": ps.get_expert_model_parallel_group(),
    }


def _global_name(model: Any, shape: ModelShape, name: str, ep_rank: int, ep_size: int) -> str:
    """The full-model name of a local parameter (global layer and expert indices)."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    if "local_experts" in parts:
        j = parts.index("local_experts") + 1
        parts[j] = str(ep_rank * (shape.num_experts // ep_size) + int(parts[j]))
    return ".".join(parts)


def _rule_for(rules: dict[str, TensorRule], shape: ModelShape, name: str) -> TensorRule:
    if name == "output_layer.weight" and shape.tie_word_embeddings:
        return rules["embedding.word_embeddings.weight"]  # the tied copy on the last stage
    return rules[name]


def shard(rule: TensorRule, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor."""
    if rule.kind == "replicate" or tp_size == 1 or rule.expert is not None:
        return full
    if rule.kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return full.chunk(tp_size, dim=0)[tp_rank]


def merge(rule: TensorRule, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from every TP rank's slice (inverse of `shard`)."""
    if rule.kind == "row":
        return torch.cat(shards, dim=1)
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0)


def hf_to_megatron(
    model: Any, shape: ModelShape, hf_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """This rank's megatron state dict made from full Hugging Face tensors."""
    model = unwrap(model)
    g = _groups()
    rules = {r.mcore: r for r in tensor_rules(shape)}
    if any(name.endswith(".experts.gate_up_proj") for name in hf_state):
        hf_state = weight_map.checkpoint_state(shape, hf_state)  # transformers' in-memory MoE
    out: dict[str, torch.Tensor] = {}
    for name, current in model.state_dict().items():
        if name.endswith("_extra_state"):
            out[name] = current
            continue
        rule = _rule_for(rules, shape, _global_name(model, shape, name, g["ep_rank"], g["ep_size"]))
        missing = [n for n in rule.hf if n not in hf_state]
        if missing:
            raise InvalidRequest(f"Hugging Face weights lack {missing} (needed for {name})")
        full = weight_map.fuse(rule, shape, [hf_state[n] for n in rule.hf])
        part = shard(rule, full, g["tp_rank"], g["tp_size"])
        if part.shape != current.shape:
            raise InvalidRequest(f"{name}: converted shape {tuple(part.shape)} but the model"
                                 f" has {tuple(current.shape)}")
        out[name] = part.to(dtype=current.dtype, device=current.device).contiguous()
    return out


def load_hf_weights(model: Any, shape: ModelShape, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Load full Hugging Face tensors into this rank's part of `model` (strict)."""
    unwrap(model).load_state_dict(hf_to_megatron(model, shape, hf_state), strict=True)


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face folder's *.safetensors files, read one at a time on
    access, so a rank reads only the tensors its shards need."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), file))
        if not self.files:
            raise InvalidRequest(f"{path}: no *.safetensors files")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def load_hf_checkpoint(model: Any, shape: ModelShape, path: str | Path) -> None:
    """Load a Hugging Face model folder's safetensors into this rank's part of `model`."""
    load_hf_weights(model, shape, SafetensorsFolder(path))


def _owner_stage(rule: TensorRule, stage_layers: list[int]) -> int:
    if rule.layer is not None:
        return owner_stage(rule.layer, stage_layers)
    return 0 if rule.mcore.startswith("embedding.") else len(stage_layers) - 1


def _local_params(model: Any, shape: ModelShape, g: dict[str, Any]) -> dict[str, torch.Tensor]:
    # Buffers too: the router's expert bias and the carried tensors of model_mla.py.
    named = [*model.named_parameters(), *model.named_buffers()]
    return {
        _global_name(model, shape, name, g["ep_rank"], g["ep_size"]): p.detach()
        for name, p in named
    }


def _full_tensor(
    rule: TensorRule, shape: ModelShape, local: dict[str, torch.Tensor], g: dict[str, Any],
    like: torch.Tensor, stage_layers: list[int],
) -> torch.Tensor:
    """Gather one full megatron tensor onto every rank (EP, then TP, then PP)."""
    owner = _owner_stage(rule, stage_layers)
    full: torch.Tensor | None = None
    if g["pp_rank"] == owner:
        tensor = local.get(rule.mcore)
        if rule.expert is not None and g["ep_size"] > 1:
            src = rule.expert // (shape.num_experts // g["ep_size"])
            if tensor is None:
                tensor = like.new_empty(rule.full_shape)
            tensor = tensor.contiguous()
            dist.broadcast(tensor, group=g["ep_group"], group_src=src)
        assert tensor is not None, rule.mcore
        if rule.kind == "replicate" or rule.expert is not None or g["tp_size"] == 1:
            full = tensor
        else:
            shards = [torch.empty_like(tensor) for _ in range(g["tp_size"])]
            dist.all_gather(shards, tensor.contiguous(), group=g["tp_group"])
            full = merge(rule, shards)
    if g["pp_size"] > 1:
        if full is None:
            full = like.new_empty(rule.full_shape)
        full = full.contiguous()
        dist.broadcast(full, group=g["pp_group"], group_src=owner)
    assert full is not None
    return full


def iter_hf_tensors(
    model: Any, shape: ModelShape, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for the whole model; every rank must drive it."""
    model = unwrap(model)
    g = _groups()
    local = _local_params(model, shape, g)
    like = next(iter(local.values()))
    stages = stage_layer_counts(model)
    for rule in tensor_rules(shape):
        full = _full_tensor(rule, shape, local, g, like, stages)
        for name, tensor in zip(rule.hf, weight_map.unfuse(rule, shape, full), strict=True):
            yield name, tensor if dtype is None else tensor.to(dtype)


def iter_hf_buckets(
    model: Any, shape: ModelShape, bucket_mb: float, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full Hugging Face tensors grouped into buckets of at most `bucket_mb` MiB (a larger
    tensor gets a bucket of its own)."""
    limit = bucket_mb * 2**20
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in iter_hf_tensors(model, shape, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
