"""MoE experts: megatron's SequentialMLP (a Python loop over experts) against GroupedExperts
(grouped matmuls), one MoE layer's forward and backward.

Each shape builds the trainer's MoE layer twice (the production TransformerConfig and layer
spec of model.py, allgather dispatcher, one rank), the grouped one loaded from the sequential
one's state dict, and times forward + backward of random hidden states, the two layers
alternating step by step after `--warmup` steps each; the median of `--steps` is reported with
the speedup. On CUDA the default shapes are GLM-5.2-like (hidden 6144, expert FFN 2048,
top-8) at 32 and 64 experts, and a 128-expert shape, in bf16; on the CPU, small shapes like
those `riptide up` and the tests train, in fp32. The last line printed is the JSON summary.

    python bench/moe_experts.py [--device cpu|cuda] [--steps 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (hidden, experts, expert FFN, top-k, tokens)
CPU_SHAPES = [(64, 4, 32, 2, 512), (256, 8, 128, 2, 2048), (256, 64, 128, 8, 1024),
              (512, 16, 256, 4, 4096)]
CUDA_SHAPES = [(6144, 32, 2048, 8, 8192), (6144, 64, 2048, 8, 16384), (2048, 128, 768, 8, 16384)]


def _layers(hidden: int, experts: int, ffn: int, topk: int, dtype: str) -> tuple[Any, Any]:
    import torch

    from services.trainer.model.grouped_experts import with_grouped_experts
    from services.trainer.model.model import (
        ModelShape,
        _allow_moe_without_te,
        attention_spec,
        transformer_config,
    )

    shape = ModelShape(vocab_size=128, hidden_size=hidden, num_layers=1, num_heads=8,
                       num_kv_heads=8, head_dim=hidden // 8, ffn_hidden_size=ffn, norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=False,
                       qkv_bias=False, qk_norm=False, num_experts=experts, moe_topk=topk,
                       moe_ffn_hidden_size=ffn)  # fmt: skip
    config = transformer_config(shape, dtype=dtype)
    _allow_moe_without_te()
    spec = attention_spec(shape, "fused", 1)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    sequential = MoELayer(config, spec.submodules.mlp.submodules, layer_number=1)
    grouped = MoELayer(config, with_grouped_experts(spec).submodules.mlp.submodules,
                       layer_number=1)
    grouped.load_state_dict(sequential.state_dict())
    if torch.cuda.is_available():
        sequential.cuda()
        grouped.cuda()
    return sequential, grouped


def _step(layer: Any, hidden: Any) -> float:
    import torch

    x = hidden.clone().requires_grad_(True)
    if hidden.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = layer(x)
    out.float().square().mean().backward()
    if hidden.is_cuda:
        torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _time(layers: tuple[Any, Any], hidden: Any, steps: int, warmup: int) -> list[float]:
    """Median seconds of each layer's step; the layers alternate, so load that comes and goes
    on a shared machine falls on both."""
    times: list[list[float]] = [[], []]
    for i in range(warmup + steps):
        for j, layer in enumerate(layers):
            elapsed = _step(layer, hidden)
            if i >= warmup:
                times[j].append(elapsed)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    import torch

    from services.common.ports import free_port
    from services.trainer.model_config import ParallelConfig
    from services.trainer.parallel.parallel import init_parallel

    if (args.device == "cuda") != torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} but CUDA available: {torch.cuda.is_available()}")
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    results = []
    for hidden, experts, ffn, topk, tokens in CUDA_SHAPES if cuda else CPU_SHAPES:
        sequential, grouped = _layers(hidden, experts, ffn, topk, dtype)
        x = torch.randn(tokens, 1, hidden, dtype=getattr(torch, dtype),
                        device="cuda" if cuda else "cpu")
        seq_s, grp_s = _time((sequential, grouped), x, args.steps, args.warmup)
        row = {"hidden": hidden, "experts": experts, "expert_ffn": ffn, "topk": topk,
               "tokens": tokens, "sequential_s": round(seq_s, 5), "grouped_s": round(grp_s, 5),
               "speedup": round(seq_s / grp_s, 3)}  # fmt: skip
        if cuda:
            flops = 3 * 2 * 3 * tokens * topk * hidden * ffn  # fwd + bwd of the 3 projections
            row["grouped_tflops"] = round(flops / grp_s / 1e12, 1)
            row["sequential_tflops"] = round(flops / seq_s / 1e12, 1)
        print(row, flush=True)
        results.append(row)
        del sequential, grouped
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "dtype": dtype, "shapes": results}))


if __name__ == "__main__":
    main()
